"""engine.v1 `SubscribeCacheEvents` (proto/engine/v1/cache.proto): the prefix cache's events, token-id native.

The contract, as served from this frontend's `CacheEventHub`:
  start_sequence_number 0, or an instance_id not this engine's   a snapshot (parts numbered alike), then live.
  N > 0 (this instance)   the batches from N on (the hub's replay), then live; N = the next number: live only.
      N no longer replayable (the subscriber was away too long)  a snapshot instead: the documented resync.
      N past the next number to be published                      INVALID_ARGUMENT (a number from the future).
  a subscriber that leaves too many batches unread                ABORTED (resubscribe with its cursor + 1).
  limit of concurrent streams reached                             RESOURCE_EXHAUSTED.
  starting, draining, engine failed                               UNAVAILABLE.
Every batch carries the Load (GetLoad's numbers); a heartbeat (no events, the last number sent) follows a
second without a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine_proto.engine.v1 import cache_pb2
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from engine_server.frontend.cache_events import (
    CacheBatch,
    CacheEventHub,
    CursorOutOfRange,
    SubscriberFellBehind,
    TooManySubscriptions,
)
from engine_server.frontend.types import BlocksRemoved, BlocksStored, CacheEvent, EngineDead

HEARTBEAT_S = 1.0
SNAPSHOT_PART_BLOCKS = 1024  # blocks per snapshot part

Response = cache_pb2.SubscribeCacheEventsResponse
FillLoad = Callable[[Any], None]  # fills a Load message with the engine's current numbers


def add_events(response: Response, events: list[CacheEvent], block_size: int) -> None:
    for event in events:
        if type(event) is BlocksStored:
            stored = response.events.add().stored
            stored.block_hashes.extend(event.block_hashes)
            if event.parent_hash is not None:
                stored.parent_hash = event.parent_hash
            for tokens in event.token_ids:
                stored.token_ids.extend(tokens)
            stored.block_size = block_size
            stored.cache_salt = event.cache_salt
        elif type(event) is BlocksRemoved:
            response.events.add().removed.block_hashes.extend(event.block_hashes)
        else:
            response.events.add().cleared.SetInParent()


def responses_of(batch: CacheBatch, instance_id: str, block_size: int) -> list[Response]:
    """One batch's response, or a snapshot's parts (each SNAPSHOT_PART_BLOCKS blocks or so)."""
    if not batch.is_snapshot:
        response = Response(sequence_number=batch.sequence_number, instance_id=instance_id)
        add_events(response, batch.events, block_size)
        return [response]
    parts: list[list[CacheEvent]] = [[batch.events[0]]]  # the clear, then stored chains
    size = 0
    for event in batch.events[1:]:
        if size >= SNAPSHOT_PART_BLOCKS:
            parts.append([])
            size = 0
        parts[-1].append(event)
        size += len(event.block_hashes) if type(event) is BlocksStored else 0
    responses = []
    for index, part in enumerate(parts):
        response = Response(sequence_number=batch.sequence_number, instance_id=instance_id)
        add_events(response, part, block_size)
        response.snapshot.index = index
        response.snapshot.count = len(parts)
        responses.append(response)
    return responses


async def serve_cache_events(stream: Any, request: cache_pb2.SubscribeCacheEventsRequest, hub: CacheEventHub,
                             fill_load: FillLoad) -> None:
    """One SubscribeCacheEvents call after its request was read; ends with an error status or a cancel."""
    start: int = request.start_sequence_number
    instance_id: str = request.instance_id

    def position(hub: CacheEventHub) -> int | None:
        if start == 0 or (instance_id and instance_id != hub.instance_id):
            return None
        return start - 1

    try:
        try:
            subscription = await hub.subscribe(position)
        except CursorOutOfRange as exc:
            if exc.is_future:
                raise GRPCError(Status.INVALID_ARGUMENT, f"start_sequence_number: {exc}") from None
            subscription = await hub.subscribe(lambda _hub: None)  # gone from the replay: resync
    except TooManySubscriptions as exc:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from None
    except EngineDead as exc:
        raise GRPCError(Status.UNAVAILABLE, str(exc)) from None
    with subscription:
        last_sent = 0
        while True:
            try:
                batches = await subscription.get(HEARTBEAT_S)
            except SubscriberFellBehind as exc:
                raise GRPCError(Status.ABORTED, f"{exc}: resubscribe with your cursor + 1") from None
            except EngineDead as exc:
                raise GRPCError(Status.UNAVAILABLE, str(exc)) from None
            if not batches:
                heartbeat = Response(sequence_number=last_sent or hub.last_sequence_number,
                                     instance_id=hub.instance_id, heartbeat=True)
                fill_load(heartbeat.load)
                await stream.send_message(heartbeat)
                continue
            for batch in batches:
                for response in responses_of(batch, hub.instance_id, hub.block_size):
                    fill_load(response.load)
                    await stream.send_message(response)
                last_sent = batch.sequence_number
