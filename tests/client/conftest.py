from __future__ import annotations

from collections.abc import Iterator

import pytest
from client_fake_server import FakeServer, run_fake_server


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    with run_fake_server() as server:
        yield server


@pytest.fixture
def fake(fake_server: FakeServer) -> FakeServer:
    fake_server.state.reset()
    return fake_server
