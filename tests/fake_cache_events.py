"""A stand-in for the engine core's cache-event side, for fake engines: a CacheEventHub whose subscription
is answered with an empty snapshot, and `publish` to hand it batches as the core would."""

from __future__ import annotations

import asyncio
import time

from engine_server.core.cache_messages import CacheEventBatch, CacheEventsCommand, CacheEventsStart
from engine_server.engine.kv_events import CacheCleared, CacheEvent
from engine_server.frontend.cache_events import CacheEventHub

INSTANCE_STARTED_US = 1_000_000


class FakeCacheCore:
    def __init__(self, *, block_size: int = 16, **hub_options: float) -> None:
        self.hub = CacheEventHub(self._command, **hub_options)  # type: ignore[arg-type]
        self.block_size = block_size
        self.is_subscribed = False
        self.commands: list[bool] = []
        self.number = 0

    def _command(self, command: CacheEventsCommand) -> None:
        self.commands.append(command.subscribe)
        self.is_subscribed = command.subscribe
        if command.subscribe:
            self.number += 1
            start = CacheEventsStart("fake-instance", INSTANCE_STARTED_US, self.number, self.block_size,
                                     [CacheCleared()])
            asyncio.get_running_loop().call_soon(self.hub.on_start, start)

    def publish(self, events: list[CacheEvent]) -> None:
        """One step's batch, if a frontend subscribes (as the core publishes only then)."""
        if self.is_subscribed:
            self.number += 1
            self.hub.on_batch(CacheEventBatch(self.number, time.time(), events))
