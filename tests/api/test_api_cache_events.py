"""engine.v1 SubscribeCacheEvents on a real server (the shared one), through the generated grpclib stub.

A stream starts with a snapshot (parts numbered alike, part 0 a clear), then batches numbered without gaps,
token-id native (the tokens of each stored block, its salt), each with the Load, and heartbeats while
nothing changes; a resume replays what was missed; a number from the future is INVALID_ARGUMENT; another
instance's cursor resyncs with a snapshot; two subscribers see the same batches.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from engine_proto.engine.v1 import cache_pb2, generate_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from serverproc import RunningServer

BLOCK_SIZE = 16
TIMEOUT_S = 60.0

Blocks = dict[int, tuple[tuple[int, ...], str]]  # hash -> (tokens, salt)


@contextlib.asynccontextmanager
async def subscribe(server: RunningServer, start: int = 0, instance_id: str = "") -> AsyncIterator[Any]:
    channel = Channel("127.0.0.1", server.port)
    try:
        async with EngineServiceStub(channel).SubscribeCacheEvents.open(timeout=TIMEOUT_S) as stream:
            await stream.send_message(cache_pb2.SubscribeCacheEventsRequest(
                start_sequence_number=start, instance_id=instance_id), end=True)
            yield stream
            await stream.cancel()
    finally:
        channel.close()


async def next_response(stream: Any, *, heartbeat: bool = False) -> cache_pb2.SubscribeCacheEventsResponse:
    while True:
        response = await asyncio.wait_for(stream.recv_message(), TIMEOUT_S)
        assert response is not None, "the stream ended"
        assert response.HasField("load")
        assert response.instance_id
        if response.heartbeat == heartbeat:
            return response  # type: ignore[no-any-return]


def apply(blocks: Blocks, response: cache_pb2.SubscribeCacheEventsResponse) -> None:
    for event in response.events:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            stored = event.stored
            assert stored.block_size == BLOCK_SIZE
            assert len(stored.token_ids) == BLOCK_SIZE * len(stored.block_hashes)
            for i, block_hash in enumerate(stored.block_hashes):
                tokens = tuple(stored.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
                blocks[block_hash] = (tokens, stored.cache_salt)
        elif kind == "removed":
            for block_hash in event.removed.block_hashes:
                blocks.pop(block_hash, None)
        else:
            blocks.clear()


async def read_snapshot(stream: Any) -> tuple[cache_pb2.SubscribeCacheEventsResponse, Blocks]:
    blocks: Blocks = {}
    part = await next_response(stream)
    assert part.HasField("snapshot")
    assert part.snapshot.index == 0
    assert part.events[0].WhichOneof("kind") == "cleared"
    apply(blocks, part)
    while part.snapshot.index + 1 < part.snapshot.count:
        following = await next_response(stream)
        assert following.sequence_number == part.sequence_number
        part = following
        apply(blocks, part)
    return part, blocks


async def generate(server: RunningServer, prompt: list[int], salt: str = "") -> None:
    channel = Channel("127.0.0.1", server.port)
    try:
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), cache_salt=salt,
            sampling=generate_pb2.SamplingParams(temperature=0.0),
            stopping=generate_pb2.StoppingCriteria(max_tokens=2))
        await EngineServiceStub(channel).Generate(request, timeout=TIMEOUT_S)
    finally:
        channel.close()


def prompt_of(seed: int, num_blocks: int = 3) -> list[int]:
    return [300 + (seed * 37 + i * 11) % 200 for i in range(num_blocks * BLOCK_SIZE + 5)]


Wanted = set[tuple[tuple[int, ...], str]]


def blocks_of(prompt: list[int], salt: str = "") -> Wanted:
    full = len(prompt) // BLOCK_SIZE
    return {(tuple(prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]), salt) for i in range(full)}


async def collect_until(stream: Any, blocks: Blocks, last: int, wanted: Wanted) -> int:
    while not wanted <= set(blocks.values()):
        response = await next_response(stream)
        assert response.sequence_number == last + 1, "a gap or a repeat"
        last = response.sequence_number
        apply(blocks, response)
    return last


async def test_snapshot_batches_salts_and_two_subscribers(server: RunningServer) -> None:
    async with subscribe(server) as first, subscribe(server) as second:
        (part1, blocks1), (part2, blocks2) = await read_snapshot(first), await read_snapshot(second)
        assert part1.instance_id == part2.instance_id
        prompt = prompt_of(1)
        await generate(server, prompt)
        await generate(server, prompt, salt="tenant-b")  # the same tokens under a salt: blocks of its own
        wanted = blocks_of(prompt) | blocks_of(prompt, "tenant-b")
        await collect_until(first, blocks1, part1.sequence_number, wanted)
        await collect_until(second, blocks2, part2.sequence_number, wanted)
        assert blocks1 == blocks2
        # nothing changes now: a heartbeat with the load, repeating the last number
        heartbeat = await next_response(first, heartbeat=True)
        assert not heartbeat.events


async def test_resume_replays_what_was_missed_and_other_instances_resync(server: RunningServer) -> None:
    async with subscribe(server) as stream:
        part, blocks = await read_snapshot(stream)
        last, instance_id = part.sequence_number, part.instance_id
        async with subscribe(server, last + 1, instance_id) as live_only:  # the next number: live batches
            prompt = prompt_of(2)
            await generate(server, prompt)
            resumed: Blocks = dict(blocks)
            await collect_until(live_only, resumed, last, blocks_of(prompt))
        # a cursor of another instance (a restarted server): a snapshot, whatever the number says
        async with subscribe(server, 3, "another-instance") as other:
            _, snapshot = await read_snapshot(other)
            assert blocks_of(prompt) <= set(snapshot.values())


async def test_a_number_from_the_future_is_invalid_argument(server: RunningServer) -> None:
    async with subscribe(server) as stream:
        part, _ = await read_snapshot(stream)
        with pytest.raises(GRPCError) as info:
            async with subscribe(server, part.sequence_number + 1000, part.instance_id) as future:
                await next_response(future)
        assert info.value.status is Status.INVALID_ARGUMENT


async def test_flush_cache_reaches_subscribers_as_a_cleared_event(server: RunningServer) -> None:
    async with subscribe(server) as stream:
        part, blocks = await read_snapshot(stream)
        prompt = prompt_of(3)
        await generate(server, prompt)
        last = await collect_until(stream, blocks, part.sequence_number, blocks_of(prompt))
        channel = Channel("127.0.0.1", server.port)
        try:
            await EngineServiceStub(channel).FlushCache(cache_pb2.FlushCacheRequest(), timeout=TIMEOUT_S)
        finally:
            channel.close()
        while blocks:  # the flush's batch: a clear (the subscriber's copy empties)
            response = await next_response(stream)
            assert response.sequence_number == last + 1
            last = response.sequence_number
            apply(blocks, response)
        assert any(event.WhichOneof("kind") == "cleared" for event in response.events)
