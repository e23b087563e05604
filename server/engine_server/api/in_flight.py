"""The Generate calls running in this process (every service): what a drain waits for before closing, and
each call's resources, released in one place."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine_server.api.stream_limit import StreamSlot


class _Closable(Protocol):
    def close(self) -> None: ...


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

    def begin(self) -> CallResources:
        """A call counted from now on; its slot and engine stream join it at admission (`admitted`)."""
        return CallResources(self)

    def admit(self, slot: StreamSlot | None, outputs: _Closable) -> CallResources:
        """A call admitted at once: counted, with its slot and engine stream."""
        resources = CallResources(self)
        resources.admitted(slot, outputs)
        return resources

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


class CallResources:
    """What one Generate call holds while it runs: its place in the in-flight count, its stream slot and its
    engine stream (closing it aborts an unfinished request).

    Taken in one place (`InFlight.begin` / `InFlight.admit`), released in one place: `release()`, which
    whatever ends the call calls (its last message written, a reset stream or lost connection, a deadline, a
    drain's abort, an engine failure, an error), on the push path or on the call's task. The first call
    releases everything; later ones do nothing, so no path has to know whether another ran first.

    NOTE: the slot may go back earlier on its own (the sender gives it back before a pushed end leaves:
    `FastSender(before_end=...)`); `StreamSlot.release` is idempotent too.
    """

    __slots__ = ("_in_flight", "_outputs", "_slot")

    def __init__(self, in_flight: InFlight) -> None:
        in_flight.enter()
        self._in_flight: InFlight | None = in_flight
        self._slot: StreamSlot | None = None
        self._outputs: _Closable | None = None

    @property
    def is_released(self) -> bool:
        return self._in_flight is None

    def admitted(self, slot: StreamSlot | None, outputs: _Closable) -> None:
        """The call's slot and engine stream, now that the engine has the request."""
        if self._in_flight is None:  # released before admission finished: nothing may outlive the call
            outputs.close()
            if slot is not None:
                slot.release()
            return
        self._slot, self._outputs = slot, outputs

    def release(self) -> None:
        in_flight = self._in_flight
        if in_flight is None:
            return
        self._in_flight = None
        outputs, slot = self._outputs, self._slot
        self._outputs = self._slot = None
        if outputs is not None:
            outputs.close()
        if slot is not None:
            slot.release()
        in_flight.leave()
