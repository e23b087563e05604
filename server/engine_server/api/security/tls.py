"""TLS contexts: the server's (TLS >= 1.2, ALPN h2, optional mutual TLS), a matching client one, and a
watcher that reloads a rotated server certificate without a restart."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl

log = logging.getLogger(__name__)

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


class CertificateWatcher:
    """Reloads a rotated server certificate and key into the live server context.

    `SSLContext.load_cert_chain` on the listening context affects new handshakes only; connections already
    open keep their certificate. A pair that does not load (say the certificate was replaced but not yet
    its key) is skipped and retried on the next check, while the old pair keeps serving.
    """

    def __init__(self, ctx: ssl.SSLContext, *, cert_file: str, key_file: str) -> None:
        self._ctx = ctx
        self._cert_file = cert_file
        self._key_file = key_file
        self._loaded = self._fingerprint()
        self.num_reloads = 0

    def _fingerprint(self) -> tuple[tuple[int, int, int], ...]:
        stats = [os.stat(path) for path in (self._cert_file, self._key_file)]
        return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in stats)

    def check(self) -> bool:
        """Reload if either file changed since the last load; True when a new pair was loaded."""
        try:
            current = self._fingerprint()
        except OSError as exc:
            log.warning("TLS certificate check failed: %s", exc)
            return False
        if current == self._loaded:
            return False
        try:
            # NOTE: a failed load_cert_chain leaves the context half-updated (new certificate, old key), so
            # the pair is tried on a scratch context first.
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self._cert_file, self._key_file)
            self._ctx.load_cert_chain(certfile=self._cert_file, keyfile=self._key_file)
        except (OSError, ssl.SSLError) as exc:
            log.warning("TLS certificate %s changed but does not load (retrying): %s", self._cert_file, exc)
            return False
        self._loaded = current
        self.num_reloads += 1
        log.info("reloaded TLS certificate %s", self._cert_file)
        return True

    async def run(self, *, interval_s: float = 60.0) -> None:
        """Check every `interval_s` until cancelled (run it as a task beside the server)."""
        while True:
            await asyncio.sleep(interval_s)
            self.check()
