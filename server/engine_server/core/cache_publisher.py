"""The core's side of the cache events: which frontends subscribe, numbering, one batch per step.

Runs on the core loop's thread. Recording in the block manager is on only while a frontend subscribes, so
an engine nobody watches builds no event. A frontend's subscription is answered with a snapshot of the
cache, numbered so that the batches after it follow without a gap.

Numbers: batches are numbered 1, 2, ... for the engine instance's life. When recording starts after a time
without any subscriber, the cache changed unrecorded meanwhile: the snapshot then takes a new number of its
own, so a subscriber's cursor from before can never pass for current (it resumes into a resync instead).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from engine_server.core.cache_messages import CacheEventBatch, CacheEventsStart
from engine_server.engine.kv_events import CachedBlock, CacheEventLog, snapshot_events


@runtime_checkable
class CacheSource(Protocol):
    """What the publisher needs of the block manager (`engine.block_manager`)."""

    block_size: int
    enable_prefix_caching: bool
    cache_events: CacheEventLog

    def cached_blocks(self) -> list[CachedBlock]: ...


Send = Callable[[int, CacheEventBatch | CacheEventsStart], None]


class CachePublisher:
    """Subscriptions of frontends (by index) to the cache events of one engine."""

    def __init__(self, source: object, send: Send) -> None:
        # An engine without a prefix cache (an embedding model, a test double) publishes no events; its
        # subscribers get an empty snapshot and then nothing but their own heartbeats.
        self._source = source if isinstance(source, CacheSource) and source.enable_prefix_caching else None
        self._send = send
        self.instance_id = secrets.token_hex(8)
        self.instance_started_us = time.time_ns() // 1000
        self._subscribers: set[int] = set()
        self._sequence_number = 0

    @property
    def is_publishing(self) -> bool:
        return bool(self._subscribers)

    def set_subscribed(self, index: int, subscribe: bool) -> None:
        if not subscribe:
            self._subscribers.discard(index)
            if not self._subscribers and self._source is not None:
                self._source.cache_events.stop()
            return
        # 1) what is recorded already belongs to the subscribers there are (a flush earlier in this round)
        self.publish()
        source = self._source
        if source is not None and not source.cache_events.is_recording:
            source.cache_events.start()
            self._sequence_number += 1  # the cache changed unrecorded: the snapshot is a new batch
        elif source is None and not self._subscribers:
            self._sequence_number += 1
        self._subscribers.add(index)
        # 2) the snapshot: a Python pass over the cached blocks, once per subscription of a frontend (the
        #    frontend keeps its own copy for its clients' snapshots)
        blocks = source.cached_blocks() if source is not None else []
        block_size = source.block_size if source is not None else 0
        self._send(index, CacheEventsStart(self.instance_id, self.instance_started_us, self._sequence_number,
                                           block_size, snapshot_events(blocks)))

    def publish(self) -> None:
        """The events since the last call, as one numbered batch to every subscriber (none: no batch)."""
        if not self._subscribers or self._source is None:
            return
        events = self._source.cache_events.take()
        if not events:
            return
        self._sequence_number += 1
        batch = CacheEventBatch(self._sequence_number, time.time(), events)
        for index in list(self._subscribers):
            self._send(index, batch)
