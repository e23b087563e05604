"""`SubscribeKvEvents` of `vllm.grpc.engine.VllmEngine`: the engine's prefix-cache events for the smg gateway.

Semantics (smg-grpc-proto `common.proto`, and what smg's subscriber does with each answer, as observed):
  start_sequence_number 0   a snapshot of the cache (`KvSnapshotChunk`s numbered consecutively, ending at the
                            state's number; chunk 0 begins with a clear), then live batches.
  start_sequence_number N   N is the subscriber's cursor (the last batch it applied; smg resubscribes so):
                            the batches after N that the replay buffer holds, then live ones. A cursor whose
                            batches are no longer kept, or from another engine instance, or past the last
                            batch published (the server restarted): OUT_OF_RANGE at once, which smg answers
                            by clearing what it knew of the worker and resubscribing from 0.
  fell behind               a subscriber that leaves too many batches unread is ended with DATA_LOSS (smg:
                            clear, resubscribe from 0); the engine never waits for it.
Numbers: this service's batch number is the engine instance's start time in microseconds plus the engine's
own number (1, 2, ...), so a restarted server's numbers never meet an old cursor's range: a cursor from before
a restart is always refused, never mistaken for current.
Load: every batch carries the `EngineLoad` record (GetLoads' numbers); `load_only` batches (no events, the
last number sent) go out when the record changed and as a heartbeat after a second of silence; before the
first batch only when the subscriber asked for them (`load_records_before_first_batch`), numbered 0.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import common_pb2

from engine_server.frontend.cache_events import (
    CacheBatch,
    CacheEventHub,
    CursorOutOfRange,
    SubscriberFellBehind,
    TooManySubscriptions,
)
from engine_server.frontend.types import BlocksRemoved, BlocksStored, CacheEvent, EngineDead, EngineStats

POLL_S = 0.1  # how often an idle stream looks at the load record
# ENGINE_SERVER_KV_EVENTS=off: the RPC answers UNIMPLEMENTED, as before it existed (smg then routes blind:
# the fleet benchmark's "cache_aware without events"; also a way out should a gateway misuse the stream).
DISABLE_ENV = "ENGINE_SERVER_KV_EVENTS"
HEARTBEAT_S = 1.0  # a load_only batch after this long without a batch
SNAPSHOT_CHUNK_BLOCKS = 1024  # blocks per snapshot chunk (~70 KB at 16 tokens a block)

_DEVICE = common_pb2.KV_CACHE_TIER_DEVICE


class LoadRecords:
    """Builds the stream's EngineLoad records from the engine's latest stats; `sample` numbers them."""

    def __init__(self, stats: Callable[[], EngineStats], *, block_size: int, max_num_seqs: int) -> None:
        self._stats = stats
        self._block_size = block_size
        self._max_num_seqs = max_num_seqs
        self._sample = 0
        self.last_key: tuple[int, int, float] | None = None

    def current_key(self) -> tuple[int, int, float]:
        stats = self._stats()
        return stats.num_running, stats.num_waiting, round(stats.kv_cache_usage, 3)

    def fill(self, load: Any, *, load_only: bool) -> None:
        stats = self._stats()
        self._sample += 1
        usage = stats.kv_cache_usage
        load.running_requests = stats.num_running
        load.waiting_requests = stats.num_waiting
        load.token_usage = usage
        # NOTE: free blocks include the cached ones a new request may take: what is used is not evictable
        load.active_token_usage = usage
        load.max_running_requests = self._max_num_seqs
        load.sample = self._sample
        load.load_only = load_only
        if load_only:  # the telemetry beyond the routing core rides on the heartbeat cadence
            load.num_used_tokens = (stats.num_total_blocks - stats.num_free_blocks) * self._block_size
            load.max_total_num_tokens = stats.num_total_blocks * self._block_size
        self.last_key = (stats.num_running, stats.num_waiting, round(usage, 3))


def add_events(batch: common_pb2.KvEventBatch, events: list[CacheEvent], block_size: int) -> int:
    """Appends the events in the proto's shape; returns how many blocks they name."""
    num_blocks = 0
    for event in events:
        if type(event) is BlocksStored:
            stored = batch.events.add().stored
            for block_hash, tokens in zip(event.block_hashes, event.token_ids, strict=True):
                stored.blocks.add(block_hash=block_hash, token_ids=tokens, block_size=block_size)
            if event.parent_hash is not None:
                stored.parent_block_hash = event.parent_hash
            stored.tier = _DEVICE
            if event.cache_salt:
                stored.cache_salt = event.cache_salt
            num_blocks += len(event.block_hashes)
        elif type(event) is BlocksRemoved:
            removed = batch.events.add().removed
            removed.block_hashes.extend(event.block_hashes)
            removed.tier = _DEVICE
            num_blocks += len(event.block_hashes)
        else:
            batch.events.add().cleared.SetInParent()
    return num_blocks


def snapshot_chunks(snapshot: CacheBatch, number: int, block_size: int) -> list[common_pb2.KvEventBatch]:
    """A snapshot as KvSnapshotChunks numbered consecutively up to `number` (its state's number)."""
    events = snapshot.events  # a clear, then stored chains
    num_blocks = sum(len(e.block_hashes) for e in events if type(e) is BlocksStored)
    parts: list[list[CacheEvent]] = [[events[0]]]
    size = 0
    for event in events[1:]:
        assert type(event) is BlocksStored
        if size >= SNAPSHOT_CHUNK_BLOCKS:
            parts.append([])
            size = 0
        parts[-1].append(event)
        size += len(event.block_hashes)
    now = time.time()
    chunks = []
    for index, part in enumerate(parts):
        chunk = common_pb2.KvEventBatch(sequence_number=number - len(parts) + 1 + index, timestamp=now)
        add_events(chunk, part, block_size)
        chunk.snapshot.index = index
        chunk.snapshot.count = len(parts)
        chunk.snapshot.blocks = num_blocks
        chunks.append(chunk)
    return chunks


async def serve_kv_events(stream: Any, hub: CacheEventHub, loads: LoadRecords) -> None:
    """One SubscribeKvEvents call; it ends only with an error status or when the client cancels (grpclib
    cancels this coroutine; the subscription is released on the way out)."""
    request = await stream.recv_message()
    if os.environ.get(DISABLE_ENV) == "off":
        raise GRPCError(Status.UNIMPLEMENTED, f"KV cache events are switched off ({DISABLE_ENV}=off)")
    if request is None:
        raise GRPCError(Status.INVALID_ARGUMENT, "empty request")
    start: int = request.start_sequence_number

    def position(hub: CacheEventHub) -> int | None:
        if start == 0:
            return None
        if start < hub.instance_started_us:
            raise CursorOutOfRange(f"start_sequence_number {start} is not from this engine instance "
                                   f"(its numbers start at {hub.instance_started_us + 1})",
                                   is_future=False)
        return start - hub.instance_started_us

    try:
        subscription = await hub.subscribe(position)
    except CursorOutOfRange as exc:
        raise GRPCError(Status.OUT_OF_RANGE, f"{exc}; resubscribe from 0 for a snapshot") from None
    except TooManySubscriptions as exc:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from None
    except EngineDead as exc:
        raise GRPCError(Status.UNAVAILABLE, str(exc)) from None
    with subscription:
        offset = hub.instance_started_us
        block_size = hub.block_size
        last_sent = 0  # the number of the last batch sent on this stream (0: none yet)
        last_send_time = time.monotonic()
        if request.load_records_before_first_batch:
            heartbeat = common_pb2.KvEventBatch(sequence_number=0, timestamp=time.time())
            loads.fill(heartbeat.load, load_only=True)
            await stream.send_message(heartbeat)
        while True:
            try:
                batches = await subscription.get(POLL_S)
            except SubscriberFellBehind as exc:
                raise GRPCError(Status.DATA_LOSS, f"{exc}: resubscribe from 0 for a snapshot") from None
            except EngineDead as exc:
                raise GRPCError(Status.UNAVAILABLE, str(exc)) from None
            for batch in batches:
                number = offset + batch.sequence_number
                if batch.is_snapshot:
                    messages = snapshot_chunks(batch, number, block_size)
                else:
                    message = common_pb2.KvEventBatch(sequence_number=number, timestamp=batch.timestamp)
                    add_events(message, batch.events, block_size)
                    messages = [message]
                for message in messages:
                    loads.fill(message.load, load_only=False)
                    await stream.send_message(message)
                last_sent = number
                last_send_time = time.monotonic()
            if batches or (last_sent == 0 and not request.load_records_before_first_batch):
                continue
            # 2) no batch: a load record when it changed, or as the heartbeat
            if loads.current_key() != loads.last_key or time.monotonic() - last_send_time >= HEARTBEAT_S:
                heartbeat = common_pb2.KvEventBatch(sequence_number=last_sent, timestamp=time.time())
                loads.fill(heartbeat.load, load_only=True)
                await stream.send_message(heartbeat)
                last_send_time = time.monotonic()
