"""A transport wrapper that batches every write of one event-loop tick into one write (one syscall).

HTTP/2 multiplexes all of a client's streams on one connection: when an engine step wakes 256 Generate
handlers, grpclib writes 256 DATA frames (plus h2's WINDOW_UPDATEs) to the same socket in the same tick.
Unbatched that is one send() each; batched, one for the lot, and the client reads them in one recv().
Latency is unchanged: the batch goes out at the end of the tick that produced it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class BatchingTransport(asyncio.Transport):
    """Forwards everything to `inner`; `write` is deferred to the end of the current loop iteration."""

    __slots__ = ("_inner", "_loop", "_pending")

    def __init__(self, inner: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._inner = inner
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        pending = self._pending
        if not pending:
            self._loop.call_soon(self.flush)
        # NOTE: a copy only of what the writer may still change (a bytearray, a memoryview of one)
        pending.append(data if type(data) is bytes else bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        if not self._inner.is_closing():
            self._inner.write(data)

    def get_write_buffer_size(self) -> int:
        return self._inner.get_write_buffer_size() + sum(len(data) for data in self._pending)

    def close(self) -> None:
        self.flush()  # NOTE: a GOAWAY written just before close must still go out
        self._inner.close()

    def abort(self) -> None:
        self._pending.clear()
        self._inner.abort()

    def write_eof(self) -> None:
        self.flush()
        self._inner.write_eof()

    def can_write_eof(self) -> bool:
        return self._inner.can_write_eof()

    def is_closing(self) -> bool:
        return self._inner.is_closing()

    @property
    def inner_is_closing(self) -> Callable[[], bool]:
        """The wrapped transport's `is_closing` (the same answer, one call less: for per-message checks)."""
        is_closing: Callable[[], bool] = self._inner.is_closing
        return is_closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._inner.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._inner.pause_reading()

    def resume_reading(self) -> None:
        self._inner.resume_reading()

    def is_reading(self) -> bool:
        return self._inner.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._inner.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        limits: tuple[int, int] = getattr(self._inner, "get_write_buffer_limits")()  # noqa: B009 - not typed
        return limits

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._inner.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._inner.get_protocol()
