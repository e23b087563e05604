"""The pipe's messages for prefix-cache events (issue 40): a frontend subscribes, the core publishes.

Torch-free: the frontends import it. The events themselves are `engine.kv_events`' NamedTuples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine_server.engine.kv_events import CacheEvent


@dataclass(frozen=True, slots=True)
class CacheEventsCommand:
    """Frontend -> core: start (`subscribe`) or stop receiving the cache's events. The core records events
    only while at least one frontend subscribes."""

    subscribe: bool


class CacheEventsStart(NamedTuple):
    """Core -> one frontend, in answer to its subscription: the cache's state as of batch `sequence_number`
    (a snapshot: a clear, then every cached block stored); batches numbered after it follow."""

    instance_id: str  # this engine instance (random, chosen at the core's start)
    instance_started_us: int  # when it started, in microseconds since the epoch
    sequence_number: int
    block_size: int
    events: list[CacheEvent]


class CacheEventBatch(NamedTuple):
    """Core -> every subscribed frontend: one step's changes (numbered 1, 2, ... without gaps)."""

    sequence_number: int
    timestamp: float  # time.time() when the core published it
    events: list[CacheEvent]
