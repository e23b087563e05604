"""Fixtures of the engine-client tests: the in-test fake server, and ONE real engine-server for the session.

The real server (tiny model, loopback) is shared by the end-to-end, README and wheel-install tests, so the
suite pays its start-up once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from client_fake_server import FakeServer, run_fake_server
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
def engine_server() -> Iterator[RunningServer]:
    """A real engine-server on the embedded tiny model (random weights, deterministic)."""
    with start_server("--max-num-seqs", "16", "--log-level", "warning") as server:
        yield server
