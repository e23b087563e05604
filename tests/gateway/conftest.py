from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from engine_server.api.vllm_compat import VllmCompatOptions, vllm_handlers
from fake_engine import FakeEngine
from grpclib.client import Channel
from grpclib.server import Server
from vllm_client import VllmClient


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    """A model directory with tokenizer files (one larger than a GetTokenizer chunk) and one that is not."""
    directory = tmp_path / "model"
    directory.mkdir()
    vocab = {f"tok{i}": i for i in range(20000)}
    (directory / "tokenizer.json").write_text(repr(vocab), encoding="utf-8")  # ~300 KB
    (directory / "tokenizer_config.json").write_text('{"eos_token": "</s>"}', encoding="utf-8")
    (directory / "chat_template.jinja").write_text("{{ messages }}", encoding="utf-8")
    (directory / "config.json").write_text('{"model_type": "llama"}', encoding="utf-8")
    (directory / "model.safetensors").write_bytes(b"\0" * 1024)
    return directory


@pytest.fixture(params=[False, True], ids=["pull", "push"])
def engine(tokenizer_dir: Path, request: pytest.FixtureRequest) -> FakeEngine:
    """Every servicer test twice: outputs through the handler's iterator, and offered to its push sink
    first."""
    return FakeEngine(tokenizer_dir, push=request.param)


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[VllmClient]:
    options = VllmCompatOptions(served_model_name="fake", max_num_seqs=8)
    server = Server(vllm_handlers(engine, options=options))
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # grpclib has no accessor
    channel = Channel("127.0.0.1", port)
    try:
        yield VllmClient(channel)
    finally:
        channel.close()
        server.close()
        await server.wait_closed()
