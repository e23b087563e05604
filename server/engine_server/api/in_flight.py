"""The Generate handlers running in this process (every service): what a drain waits for before closing."""

from __future__ import annotations

import asyncio
from types import TracebackType


class InFlight:
    """`with in_flight:` (or `enter()` ... `leave()`) around a handler's streaming part; `wait_idle()` returns
    once none is left.

    NOTE: one per server, shared by engine.v1 and the vLLM-compatible service, so a drain sees both. Unlike
    the stream limit (server-wide with --api-workers), it counts this process's handlers only: they are what
    this process must let finish before closing its connections.
    """

    __slots__ = ("_count", "_idle")

    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def count(self) -> int:
        return self._count

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def enter(self) -> None:
        self._count += 1
        self._idle.clear()

    def leave(self) -> None:
        self._count -= 1
        if self._count == 0:
            self._idle.set()

    def __enter__(self) -> None:
        self.enter()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.leave()
