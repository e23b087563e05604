"""TLS, mTLS and API-key paths of both clients against a real engine-server started with all three."""

from __future__ import annotations

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
from serverproc import RunningServer


def _options(server: RunningServer, certs: Any, *, api_key: str | None,
             client_cert: bool = True) -> ConnectionOptions:
    tls = TLSConfig(ca_file=certs.ca, cert_file=certs.client_cert if client_cert else None,
                    key_file=certs.client_key if client_cert else None)
    return ConnectionOptions(server.target, tls=tls, api_key=api_key, timeout=60,
                             retry=RetryPolicy(max_attempts=1))


async def test_async_mtls_with_api_key(secure_server: RunningServer, certs: Any,
                                       secure_api_key: str) -> None:
    async with AsyncEngineClient(_options(secure_server, certs, api_key=secure_api_key)) as client:
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


def test_sync_mtls_with_api_key(secure_server: RunningServer, certs: Any, secure_api_key: str) -> None:
    with EngineClient(_options(secure_server, certs, api_key=secure_api_key)) as client:
        chunks = list(client.generate("Hello", max_tokens=3, ignore_eos=True))
        assert sum(len(c.token_ids) for c in chunks) == 3
    with EngineClient(_options(secure_server, certs, api_key=None)) as anonymous:
        assert anonymous.health() is HealthStatus.SERVING
        with pytest.raises(AuthenticationError):
            anonymous.tokenize("Hello")


async def test_without_a_client_certificate_the_connection_fails(secure_server: RunningServer,
                                                                 certs: Any, secure_api_key: str) -> None:
    options = _options(secure_server, certs, api_key=secure_api_key, client_cert=False)
    async with AsyncEngineClient(options) as client:
        with pytest.raises(UnavailableError):
            await client.model_info(timeout=10)
    with EngineClient(options) as sync_client, pytest.raises(UnavailableError):
        sync_client.model_info(timeout=10)


async def test_plaintext_client_cannot_talk_to_a_tls_server(secure_server: RunningServer,
                                                            secure_api_key: str) -> None:
    options = ConnectionOptions(secure_server.target, api_key=secure_api_key,
                                retry=RetryPolicy(max_attempts=1))
    async with AsyncEngineClient(options) as client:
        with pytest.raises(UnavailableError):
            await client.model_info(timeout=10)
