"""TLS, mTLS and API-key paths of both clients against a real engine-server started with all three."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from engine_client import (
    AsyncEngineClient,
    AuthenticationError,
    ConnectionOptions,
    EngineClient,
    FinishReason,
    HealthStatus,
    RetryPolicy,
    StatusCode,
    TLSConfig,
    UnavailableError,
)
from serverproc import RunningServer, start_server

API_KEY = "client-test-key-0123456789"


def _sec_certs() -> ModuleType:
    """The security tests' certificate factory (tests/security/sec_certs.py), reused rather than copied."""
    if "sec_certs" in sys.modules:
        return sys.modules["sec_certs"]
    path = Path(__file__).parent.parent / "security" / "sec_certs.py"
    spec = importlib.util.spec_from_file_location("sec_certs", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sec_certs"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _sec_certs().make_cert_files(tmp_path_factory.mktemp("client-certs"))


@pytest.fixture(scope="module")
def secure_server(certs: Any) -> Iterator[RunningServer]:
    with start_server("--in-process-engine", "--log-level", "warning", "--api-key", API_KEY,
                      "--tls-cert", certs.server_cert, "--tls-key", certs.server_key,
                      "--tls-client-ca", certs.ca) as server:
        yield server


def _options(server: RunningServer, certs: Any, *, api_key: str | None = API_KEY,
             client_cert: bool = True) -> ConnectionOptions:
    tls = TLSConfig(ca_file=certs.ca, cert_file=certs.client_cert if client_cert else None,
                    key_file=certs.client_key if client_cert else None)
    return ConnectionOptions(server.target, tls=tls, api_key=api_key, timeout=60,
                             retry=RetryPolicy(max_attempts=1))


async def test_async_mtls_with_api_key(secure_server: RunningServer, certs: Any) -> None:
    async with AsyncEngineClient(_options(secure_server, certs)) as client:
        result = await client.complete("Hello", max_tokens=3, temperature=0.0, ignore_eos=True)
        assert result.finish_reason is FinishReason.LENGTH
        assert len(result.token_ids) == 3
    async with AsyncEngineClient(_options(secure_server, certs, api_key=None)) as anonymous:
        assert await anonymous.health() is HealthStatus.SERVING  # probes need no key
        with pytest.raises(AuthenticationError) as info:
            await anonymous.model_info()
        assert info.value.code is StatusCode.UNAUTHENTICATED
    async with AsyncEngineClient(_options(secure_server, certs, api_key="wrong-key")) as wrong:
        with pytest.raises(AuthenticationError):
            await wrong.complete("Hello", max_tokens=1)


def test_sync_mtls_with_api_key(secure_server: RunningServer, certs: Any) -> None:
    with EngineClient(_options(secure_server, certs)) as client:
        chunks = list(client.generate("Hello", max_tokens=3, ignore_eos=True))
        assert sum(len(c.token_ids) for c in chunks) == 3
    with EngineClient(_options(secure_server, certs, api_key=None)) as anonymous:
        assert anonymous.health() is HealthStatus.SERVING
        with pytest.raises(AuthenticationError):
            anonymous.tokenize("Hello")


async def test_without_a_client_certificate_the_connection_fails(secure_server: RunningServer,
                                                                 certs: Any) -> None:
    async with AsyncEngineClient(_options(secure_server, certs, client_cert=False)) as client:
        with pytest.raises(UnavailableError):
            await client.model_info(timeout=10)
    with EngineClient(_options(secure_server, certs, client_cert=False)) as sync_client, pytest.raises(
            UnavailableError):
        sync_client.model_info(timeout=10)


async def test_plaintext_client_cannot_talk_to_a_tls_server(secure_server: RunningServer) -> None:
    options = ConnectionOptions(secure_server.target, api_key=API_KEY, retry=RetryPolicy(max_attempts=1))
    async with AsyncEngineClient(options) as client:
        with pytest.raises(UnavailableError):
            await client.model_info(timeout=10)
