"""`grpc.health.v1.Health` for "" and "engine.v1.EngineService", driven by the server's state.

SERVING only once the model is loaded and warmed up; NOT_SERVING while starting, draining, or after an engine
failure. The status is read live on every Check; Watch subscribers are notified by `refresh()`, which the
server calls on its own transitions and from a slow monitor that notices engine failures.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from grpclib.health.check import CheckBase
from grpclib.health.service import OVERALL, Health

if TYPE_CHECKING:
    from grpclib._typing import IServable


class LiveCheck(CheckBase):
    """A health check whose value is a function of the server's state."""

    def __init__(self, is_serving: Callable[[], bool]) -> None:
        self._is_serving = is_serving
        self._last: bool | None = None
        self._events: set[asyncio.Event] = set()

    def __status__(self) -> bool:
        return self._is_serving()

    async def __check__(self) -> bool:
        return self._is_serving()

    async def __subscribe__(self) -> asyncio.Event:
        event = asyncio.Event()
        self._events.add(event)
        return event

    async def __unsubscribe__(self, event: asyncio.Event) -> None:
        self._events.discard(event)

    def refresh(self) -> None:
        """Wake Watch streams when the status changed since the last refresh."""
        value = self._is_serving()
        if value != self._last:
            self._last = value
            for event in self._events:
                event.set()


def build_health(service: IServable, is_serving: Callable[[], bool]) -> tuple[Health, LiveCheck]:
    check = LiveCheck(is_serving)
    return Health({OVERALL: [check], service: [check]}), check
