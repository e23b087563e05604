"""`grpc.health.v1.Health`, driven by the server's state, read live on every Check.

- "" and "engine.v1.EngineService" (readiness): SERVING only once the model is loaded and warmed up;
  NOT_SERVING while starting, draining, or after an engine failure.
- "liveness" (`LIVENESS_SERVICE`): SERVING while the process works as it should, starting and draining
  included; NOT_SERVING once the engine has failed (the server is about to exit, api/runner.py). A probe of it
  also fails when the process does not answer in time (a stuck event loop, which a TCP connect does not see:
  the kernel accepts connections for a listening socket whether or not the process reads them).
Watch subscribers are notified by `refresh()`, which the server calls on its own transitions and the engine's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from grpclib.health.check import CheckBase
from grpclib.health.service import OVERALL, Health

if TYPE_CHECKING:
    from engine_server.api.transport import IServable


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


LIVENESS_SERVICE = "liveness"


class _Name:
    """A health service name that is no gRPC service: grpclib keys checks by servable (its `__mapping__`'s
    method paths name the service)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __mapping__(self) -> dict[str, Any]:
        return {f"/{self._name}/-": None}


class HealthChecks:
    """The server's checks, refreshed together."""

    def __init__(self, *checks: LiveCheck) -> None:
        self._checks = checks

    def refresh(self) -> None:
        for check in self._checks:
            check.refresh()


def build_health(
    service: IServable, *, is_serving: Callable[[], bool], is_alive: Callable[[], bool]
) -> tuple[Health, HealthChecks]:
    ready, alive = LiveCheck(is_serving), LiveCheck(is_alive)
    health = Health({OVERALL: [ready], service: [ready], _Name(LIVENESS_SERVICE): [alive]})
    return health, HealthChecks(ready, alive)
