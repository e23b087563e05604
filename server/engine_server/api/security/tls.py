"""TLS contexts: the server's (TLS >= 1.2, ALPN h2, optional mutual TLS) and a matching client one."""

from __future__ import annotations

import ssl

_ALPN = ["h2"]


def build_server_ssl_context(
    *, cert_file: str, key_file: str, client_ca_file: str | None = None
) -> ssl.SSLContext:
    """A server context for grpclib's `Server.start(ssl=...)`.

    With `client_ca_file` the handshake REQUIRES a client certificate signed by that CA (mTLS); a client
    without one, or with one from another CA, fails the handshake before any HTTP/2 byte is read.
    Unreadable or mismatched PEM files raise ValueError naming the file.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # HTTP/2 (RFC 9113 s9.2) forbids TLS compression and renegotiation; OpenSSL 3 disables both by default,
    # the flags make it explicit for older builds.
    ctx.options |= ssl.OP_NO_COMPRESSION | getattr(ssl, "OP_NO_RENEGOTIATION", 0)
    ctx.set_alpn_protocols(_ALPN)
    try:
        ctx.load_cert_chain(certfile=cert_file, keyfile=key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load TLS certificate {cert_file} / key {key_file}: {exc}") from exc
    if client_ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load TLS client CA {client_ca_file}: {exc}") from exc
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def build_client_ssl_context(
    *, ca_file: str, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A client context for `grpclib.client.Channel(ssl=...)` that trusts `ca_file` (hostname checked).

    `cert_file`/`key_file` present a client certificate for mTLS.
    """
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file must be given together")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(_ALPN)
    if cert_file is not None and key_file is not None:
        ctx.load_cert_chain(certfile=cert_file, keyfile=key_file)
    return ctx
