"""Prefix-cache events (``SubscribeCacheEvents``) as typed batches, for routers that place requests by what
each server caches.

Example::

    cursor, instance = 0, ""
    async for batch in client.subscribe_cache_events():
        if batch.is_heartbeat:
            continue  # the load only (batch.load); the cursor stays
        for event in batch.events:
            ...  # CacheBlocksStored / CacheBlocksRemoved / CacheCleared, in order
        cursor, instance = batch.sequence_number, batch.instance_id

A stream that ends with ABORTED (the subscriber fell behind) or UNAVAILABLE is resumed with
``subscribe_cache_events(start_sequence_number=cursor + 1, instance_id=instance)``: the server replays what
was missed, or starts over with a snapshot (``batch.snapshot`` set; replace what you knew with it).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_proto.engine.v1 import cache_pb2, info_pb2

from . import _convert
from .types import Load

__all__ = [
    "CacheBlocksRemoved",
    "CacheBlocksStored",
    "CacheCleared",
    "CacheEvent",
    "CacheEventBatch",
    "SnapshotPart",
]


@dataclass(frozen=True, slots=True)
class CacheBlocksStored:
    """A chain of full blocks of one sequence that became reusable, first block first."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None  # the block before the first one; None: the first block starts its sequence
    token_ids: tuple[tuple[int, ...], ...]  # each block's tokens
    block_size: int
    cache_salt: str  # "" for the shared namespace


@dataclass(frozen=True, slots=True)
class CacheBlocksRemoved:
    """Blocks that stopped being reusable."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """Every block stopped being reusable (a flush, or the start of a snapshot)."""


CacheEvent = CacheBlocksStored | CacheBlocksRemoved | CacheCleared


@dataclass(frozen=True, slots=True)
class SnapshotPart:
    index: int  # 0 .. count - 1
    count: int


@dataclass(frozen=True, slots=True)
class CacheEventBatch:
    sequence_number: int
    instance_id: str
    events: tuple[CacheEvent, ...]
    load: Load
    is_heartbeat: bool = False
    snapshot: SnapshotPart | None = None  # set on each part of a snapshot


def _event(msg: cache_pb2.CacheEvent) -> CacheEvent:
    kind = msg.WhichOneof("kind")
    if kind == "stored":
        stored = msg.stored
        size = stored.block_size
        tokens = tuple(stored.token_ids)
        return CacheBlocksStored(
            block_hashes=tuple(stored.block_hashes),
            parent_hash=stored.parent_hash if stored.HasField("parent_hash") else None,
            token_ids=tuple(tokens[i * size:(i + 1) * size] for i in range(len(stored.block_hashes))),
            block_size=size, cache_salt=stored.cache_salt)
    if kind == "removed":
        return CacheBlocksRemoved(tuple(msg.removed.block_hashes))
    return CacheCleared()


def cache_event_batch(resp: cache_pb2.SubscribeCacheEventsResponse) -> CacheEventBatch:
    return CacheEventBatch(
        sequence_number=resp.sequence_number, instance_id=resp.instance_id,
        events=tuple(_event(e) for e in resp.events),
        load=_convert.load(resp.load, info_pb2.ENGINE_STATE_SERVING),
        is_heartbeat=resp.heartbeat,
        snapshot=(SnapshotPart(resp.snapshot.index, resp.snapshot.count) if resp.HasField("snapshot")
                  else None),
    )


def subscribe_request(start_sequence_number: int, instance_id: str) -> cache_pb2.SubscribeCacheEventsRequest:
    if start_sequence_number < 0:
        raise ValueError(f"start_sequence_number: must be >= 0, got {start_sequence_number}")
    return cache_pb2.SubscribeCacheEventsRequest(start_sequence_number=start_sequence_number,
                                                 instance_id=instance_id)
