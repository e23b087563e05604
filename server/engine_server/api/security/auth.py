"""API-key authentication: one grpclib RecvRequest listener, constant-time comparison.

A RecvRequest listener runs inside grpclib's request handler before the servicer method. For a call without
a valid key it swaps the method for one that fails with UNAUTHENTICATED (a trailers-only response), so the
servicer never runs, while listeners installed later (metrics) still see the call and its status.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream

from engine_server.api.rate_limited_log import RateLimitedLog
from engine_server.api.security.config import AUTH_EXEMPT_SERVICES, validate_api_key

log = logging.getLogger(__name__)

API_KEY_ENV = "ENGINE_API_KEY"
_BEARER = "bearer "


def _digest(value: bytes) -> bytes:
    # NOTE: comparing fixed-length digests keeps compare_digest from leaking the key's length.
    return hashlib.sha256(value).digest()


def presented_key(metadata: Mapping[str, str | bytes]) -> str | None:
    """The key a call presents: `authorization: Bearer <key>` (scheme case-insensitive), else `x-api-key`."""
    authorization = metadata.get("authorization")
    if isinstance(authorization, str) and authorization[: len(_BEARER)].lower() == _BEARER:
        return authorization[len(_BEARER) :].strip()
    api_key = metadata.get("x-api-key")
    if isinstance(api_key, str):
        return api_key.strip()
    return None


class ApiKeyCheck:
    """The listener; holds only the key's digest. Rejections are logged through `log_limit` (a client can
    send calls without the key at will: one line per interval, then a count)."""

    def __init__(
        self, api_key: str, *, exempt_services: Collection[str], log_limit: RateLimitedLog | None = None
    ) -> None:
        validate_api_key(api_key)
        self._key_digest = _digest(api_key.encode("ascii"))
        self._exempt_services = frozenset(exempt_services)
        self._log_limit = log_limit if log_limit is not None else RateLimitedLog()
        self.num_rejected = 0

    def is_exempt(self, method_name: str) -> bool:
        # method_name is the :path, "/package.Service/Method".
        service = method_name.lstrip("/").partition("/")[0]
        return service in self._exempt_services

    def is_valid(self, key: str | None) -> bool:
        # NOTE: the configured key is never empty, so a missing key (hashed as "") never matches.
        presented = _digest((key or "").encode("utf-8", "surrogateescape"))
        return hmac.compare_digest(presented, self._key_digest)

    async def __call__(self, event: RecvRequest) -> None:
        event.method_func = self.wrap_method(
            event.method_func, method_name=event.method_name, metadata=event.metadata, peer=event.peer
        )

    def wrap_method(self, method_func: Any, *, method_name: str, metadata: Any, peer: Any) -> Any:
        """What the listener does to a call (also applied directly by transport/fast_path.py)."""
        if self.admits_direct(method_name, metadata):
            return method_func
        self.num_rejected += 1
        self._log_limit.log(log, logging.INFO, "calls rejected for a missing or invalid API key",
                            "rejected call to %s from %s: missing or invalid API key", method_name,
                            peer.addr())
        return _reject

    def admits_direct(self, method_name: str, metadata: Any) -> bool:
        """The call may go on as it is: exempt, or it presents the key (fast_path.DirectListener)."""
        return self.is_exempt(method_name) or self.is_valid(presented_key(metadata))

    def direct_call_ended(self, method_name: str, status: Status) -> None:
        """Nothing to do at a call's end (transport/fast_path.DirectListener)."""


async def _reject(stream: Stream[Any, Any]) -> None:
    raise GRPCError(Status.UNAUTHENTICATED, "missing or invalid API key")


def install_api_key_check(
    server: Server, api_key: str | None, *, exempt_services: Collection[str] = AUTH_EXEMPT_SERVICES,
    log_limit: RateLimitedLog | None = None,
) -> ApiKeyCheck | None:
    """Require the key on every call except to `exempt_services`; None installs nothing. `log_limit`: the
    server's (GuardedServer.log_limit), else the check's own.

    Install it before other RecvRequest listeners (grpclib runs them in order): the ones after it wrap the
    rejecting method, so they see UNAUTHENTICATED calls but never reach the servicer for them.
    """
    if api_key is None:
        return None
    check = ApiKeyCheck(api_key, exempt_services=exempt_services, log_limit=log_limit)
    listen(server, RecvRequest, check)
    return check


def resolve_api_key(
    *,
    api_key: str | None = None,
    api_key_file: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> str | None:
    """The key from the flag, else the file (surrounding whitespace stripped), else $ENGINE_API_KEY.

    Raises ValueError when both the flag and the file are given or the file cannot be read.
    """
    if api_key is not None and api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        try:
            key = Path(api_key_file).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read API key file {api_key_file}: {exc}") from exc
        if not key:
            raise ValueError(f"API key file {api_key_file} is empty")
        return key
    if api_key is not None:
        return api_key
    return environ.get(API_KEY_ENV) or None
