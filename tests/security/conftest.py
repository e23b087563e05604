from __future__ import annotations

from pathlib import Path

import pytest
from sec_certs import CertFiles, make_cert_files


@pytest.fixture(scope="session")
def cert_files(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_cert_files(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test here talks to a loopback server: bound each one well below the suite's 300 s.
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.timeout(60))
