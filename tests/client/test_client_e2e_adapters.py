"""Both clients against a real engine-server with LoRA adapters: adapter= on generate / complete and the
admin calls (load_adapter, unload_adapter, list_adapters) with the server's API key and admin key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_client import (
    AsyncEngineClient,
    ConnectionOptions,
    EngineClient,
    GenerateParams,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
)
from engine_server.models.tiny import default_model_dir
from lora_testutil import AdapterSpec, build_adapter
from serverproc import RunningServer, start_server

API_KEY, ADMIN_KEY = "sdk-api-key", "sdk-admin-key"
PROMPT = [40, 41, 42, 300, 301, 9, 8, 7]
PARAMS = GenerateParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("sdk-adapters")
    for spec in (AdapterSpec("sql", 8, ("q_proj", "k_proj", "v_proj", "o_proj"), lora_alpha=16, seed=21),
                 AdapterSpec("chat", 4, ("down_proj",), lora_alpha=8, seed=22)):
        build_adapter(default_model_dir(), root, spec)
    with start_server("--adapter", f"sql={Path(root) / 'sql'}", "--adapter-dir", str(root),
                      "--enable-adapter-admin", "--api-key", API_KEY, "--admin-key", ADMIN_KEY,
                      "--in-process-engine") as running:
        yield running


def test_sync_client_adapters(adapter_server: RunningServer) -> None:
    admin = ConnectionOptions(adapter_server.target, api_key=API_KEY, admin_key=ADMIN_KEY, timeout=60)
    with EngineClient(admin) as client:
        base = client.complete(token_ids=PROMPT, params=PARAMS).completions[0].token_ids
        sql = client.complete(token_ids=PROMPT, params=PARAMS, adapter="sql").completions[0].token_ids
        assert sql != base
        info = client.model_info()
        assert [(a.name, a.rank, a.target_modules) for a in info.adapters] == [
            ("sql", 8, ("k_proj", "o_proj", "q_proj", "v_proj"))]
        assert client.server_info().limits.max_adapters == 4
        loaded = client.load_adapter("chat", "chat")
        assert (loaded.name, loaded.rank, loaded.lora_alpha) == ("chat", 4, 8.0)
        chat = client.complete(token_ids=PROMPT, params=PARAMS, adapter="chat").completions[0].token_ids
        assert chat not in (base, sql)
        assert [a.name for a in client.list_adapters()] == ["chat", "sql"]
        client.unload_adapter("chat")
        with pytest.raises(NotFoundError):
            client.unload_adapter("chat")
        with pytest.raises(InvalidRequestError, match="outside"):
            client.load_adapter("escape", "../")
        with pytest.raises(InvalidRequestError, match="adapter"):
            client.complete(token_ids=PROMPT, params=PARAMS, adapter="chat")
    # the API key alone is not enough for the admin calls
    with EngineClient(ConnectionOptions(adapter_server.target, api_key=API_KEY, timeout=60)) as client:
        with pytest.raises(PermissionDeniedError):
            client.list_adapters()
        assert client.complete(token_ids=PROMPT, params=PARAMS, adapter="sql").completions[0].token_ids == sql


async def test_async_client_adapters(adapter_server: RunningServer) -> None:
    admin = ConnectionOptions(adapter_server.target, api_key=API_KEY, admin_key=ADMIN_KEY, timeout=60)
    async with AsyncEngineClient(admin) as client:
        loaded = await client.load_adapter("chat-async", "chat")
        assert loaded.target_modules == ("down_proj",)
        result = await client.complete(token_ids=PROMPT, params=PARAMS, adapter="chat-async")
        assert len(result.completions[0].token_ids) == 8
        assert "chat-async" in [a.name for a in await client.list_adapters()]
        await client.unload_adapter("chat-async")
        assert "chat-async" not in [a.name for a in await client.list_adapters()]
    async with AsyncEngineClient(ConnectionOptions(adapter_server.target, api_key=API_KEY,
                                                   admin_key="wrong", timeout=60)) as client:
        with pytest.raises(PermissionDeniedError):
            await client.load_adapter("x", "chat")
