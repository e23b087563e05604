"""TLS and mutual TLS: the right client is served; a client without or with a foreign certificate is not."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import ssl
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from engine_proto.engine.v1 import engine_service_pb2_grpc
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_proto.engine.v1.tokenize_pb2 import TokenizeRequest
from engine_server.api.security import SecurityConfig
from engine_server.api.security.tls import (
    CertificateWatcher,
    build_client_ssl_context,
    build_server_ssl_context,
)
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError
from sec_certs import CertFiles, reissue_server_cert
from sec_fakes import WAIT_S, serve

# What a failed handshake looks like to grpclib's client: the TLS alert, or the peer hanging up.
_HANDSHAKE_ERRORS = (ssl.SSLError, ConnectionError, StreamTerminatedError, asyncio.IncompleteReadError)


async def _tokenize(port: int, client_ctx: ssl.SSLContext) -> list[int]:
    channel = Channel("127.0.0.1", port, ssl=client_ctx)
    try:
        reply = await EngineServiceStub(channel).Tokenize(TokenizeRequest(text="ok"), timeout=WAIT_S)
        return list(reply.token_ids)
    finally:
        channel.close()


def _tls_config(cert_files: CertFiles, *, mtls: bool) -> SecurityConfig:
    return SecurityConfig(
        tls_cert_file=cert_files.server_cert,
        tls_key_file=cert_files.server_key,
        tls_client_ca_file=cert_files.ca if mtls else None,
    )


async def test_tls_serves_and_negotiates_h2(cert_files: CertFiles) -> None:
    async with serve(_tls_config(cert_files, mtls=False)) as served:
        ctx = build_client_ssl_context(ca_file=cert_files.ca)
        assert await _tokenize(served.port, ctx) == [ord("o"), ord("k")]
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(
                "127.0.0.1", served.port, ssl=build_client_ssl_context(ca_file=cert_files.ca)
            ),
            WAIT_S,
        )
        try:
            ssl_object = writer.get_extra_info("ssl_object")
            assert ssl_object.selected_alpn_protocol() == "h2"
            assert ssl_object.version() in {"TLSv1.2", "TLSv1.3"}
        finally:
            writer.close()


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
async def test_tls_rejects_plaintext_and_old_tls(cert_files: CertFiles) -> None:
    async with serve(_tls_config(cert_files, mtls=False)) as served:
        channel = Channel("127.0.0.1", served.port)
        try:
            with pytest.raises(_HANDSHAKE_ERRORS):
                await EngineServiceStub(channel).Tokenize(TokenizeRequest(text="x"), timeout=WAIT_S)
        finally:
            channel.close()
        old = build_client_ssl_context(ca_file=cert_files.ca)
        old.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
        old.maximum_version = ssl.TLSVersion.TLSv1_1
        with pytest.raises(_HANDSHAKE_ERRORS):
            await asyncio.wait_for(asyncio.open_connection("127.0.0.1", served.port, ssl=old), WAIT_S)
        assert served.engine.num_started == 0


async def test_mtls_accepts_client_signed_by_ca(cert_files: CertFiles) -> None:
    ctx = build_client_ssl_context(
        ca_file=cert_files.ca, cert_file=cert_files.client_cert, key_file=cert_files.client_key
    )
    async with serve(_tls_config(cert_files, mtls=True)) as served:
        assert await _tokenize(served.port, ctx) == [ord("o"), ord("k")]


@pytest.mark.parametrize("client", ["no_cert", "foreign_cert"])
async def test_mtls_rejects_client_without_trusted_cert(cert_files: CertFiles, client: str) -> None:
    if client == "no_cert":
        ctx = build_client_ssl_context(ca_file=cert_files.ca)
    else:
        ctx = build_client_ssl_context(
            ca_file=cert_files.ca,
            cert_file=cert_files.other_client_cert,
            key_file=cert_files.other_client_key,
        )
    async with serve(_tls_config(cert_files, mtls=True)) as served:
        with pytest.raises(_HANDSHAKE_ERRORS):
            await _tokenize(served.port, ctx)
        assert served.engine.num_started == 0
        # The server is unharmed: the right client is still served.
        good = build_client_ssl_context(
            ca_file=cert_files.ca, cert_file=cert_files.client_cert, key_file=cert_files.client_key
        )
        assert await _tokenize(served.port, good) == [ord("o"), ord("k")]


def test_bad_pem_is_a_one_line_value_error(cert_files: CertFiles) -> None:
    with pytest.raises(ValueError, match="cannot load TLS certificate"):
        build_server_ssl_context(cert_file=cert_files.server_cert, key_file=cert_files.client_key)
    with pytest.raises(ValueError, match="cannot load TLS client CA"):
        build_server_ssl_context(
            cert_file=cert_files.server_cert,
            key_file=cert_files.server_key,
            client_ca_file=cert_files.server_key,
        )


async def test_grpcio_client_over_mtls_with_api_key(cert_files: CertFiles) -> None:
    # Another HTTP/2 + TLS stack (grpc-core, like the Go and Rust clients it requires ALPN h2).
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(cert_files.ca),
        private_key=read(cert_files.client_key),
        certificate_chain=read(cert_files.client_cert),
    )
    config = dataclasses.replace(_tls_config(cert_files, mtls=True), api_key="k" * 32)
    async with (
        serve(config) as served,
        grpc.aio.secure_channel(f"localhost:{served.port}", credentials) as channel,
    ):
        stub = engine_service_pb2_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Tokenize(TokenizeRequest(text="ok"), timeout=WAIT_S)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        reply = await stub.Tokenize(
            TokenizeRequest(text="ok"), metadata=(("authorization", "Bearer " + "k" * 32),), timeout=WAIT_S
        )
        assert list(reply.token_ids) == [ord("o"), ord("k")]


async def _served_serial(port: int, ca_file: str) -> int:
    _, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=build_client_ssl_context(ca_file=ca_file)), WAIT_S
    )
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()


async def test_rotated_certificate_is_reloaded_without_restart(cert_files: CertFiles, tmp_path: Path) -> None:
    cert, key = str(tmp_path / "server.crt"), str(tmp_path / "server.key")
    first = reissue_server_cert(cert_files, cert_path=cert, key_path=key)
    config = SecurityConfig(tls_cert_file=cert, tls_key_file=key)
    ctx = build_server_ssl_context(cert_file=cert, key_file=key)
    watcher = CertificateWatcher(ctx, cert_file=cert, key_file=key)
    async with serve(config, ssl=ctx) as served:
        assert await _served_serial(served.port, cert_files.ca) == first
        assert not watcher.check()  # unchanged
        # Half-way through a rotation (new certificate, old key): skipped, the old pair keeps serving.
        shutil.copy(cert_files.client_cert, cert)
        assert not watcher.check()
        assert await _served_serial(served.port, cert_files.ca) == first
        second = reissue_server_cert(cert_files, cert_path=cert, key_path=key)
        assert watcher.check()
        assert await _served_serial(served.port, cert_files.ca) == second
        assert watcher.num_reloads == 1


async def test_started_server_reloads_rotated_certificate(cert_files: CertFiles, tmp_path: Path) -> None:
    cert, key = str(tmp_path / "server.crt"), str(tmp_path / "server.key")
    first = reissue_server_cert(cert_files, cert_path=cert, key_path=key)
    config = SecurityConfig(tls_cert_file=cert, tls_key_file=key, tls_reload_interval_s=0.02)
    async with serve(config) as served:
        assert await _served_serial(served.port, cert_files.ca) == first
        second = reissue_server_cert(cert_files, cert_path=cert, key_path=key)
        # NOTE: the reload is periodic: poll new handshakes (bounded) until one shows the new certificate.
        deadline = time.monotonic() + WAIT_S
        while (serial := await _served_serial(served.port, cert_files.ca)) != second:
            assert serial == first
            assert time.monotonic() < deadline, "certificate not reloaded"
            await asyncio.sleep(0.02)
