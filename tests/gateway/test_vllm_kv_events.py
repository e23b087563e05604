"""SubscribeKvEvents on real servers (one frontend, and --api-workers 2): what smg's subscriber relies on.

A stream starts with a load record (when asked) and a snapshot, then one batch per engine step that changed
the cache, numbered without gaps, each with the engine's load; several subscribers see the same batches;
a cursor resumes with what was missed; a cursor the server cannot serve is OUT_OF_RANGE; a cancelled stream
leaves the server as it was (a new one is served at once, the log has no traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from serverproc import RunningServer, start_server
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from vllm_client import PREFIX, VllmClient

BLOCK_SIZE = 16
TIMEOUT_S = 60.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[1, 2], ids=["one-frontend", "api-workers-2"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    args = ["--max-num-seqs", "8", "--drain-timeout", "1"]
    if request.param == 2:
        args += ["--api-workers", "2"]
    running = start_server(*args, env={"OMP_NUM_THREADS": "1"})
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.stop(signal.SIGKILL)


@contextlib.asynccontextmanager
async def subscribe(server: RunningServer, start: int = 0, *,
                    load_records: bool = True) -> AsyncIterator[Any]:
    """An open SubscribeKvEvents stream on a connection of its own (with --api-workers, any worker)."""
    host, port = server.target.rsplit(":", 1)
    channel = Channel(host, int(port))
    try:
        async with channel.request(PREFIX + "SubscribeKvEvents", Cardinality.UNARY_STREAM,
                                   common_pb2.SubscribeKvEventsRequest, common_pb2.KvEventBatch,
                                   timeout=TIMEOUT_S) as stream:
            await stream.send_message(common_pb2.SubscribeKvEventsRequest(
                start_sequence_number=start, load_records_before_first_batch=load_records), end=True)
            yield stream
            await stream.cancel()
    finally:
        channel.close()


async def next_batch(stream: Any, *, load_only: bool = False) -> Any:
    """The next batch, skipping load_only ones unless asked for one."""
    while True:
        batch = await asyncio.wait_for(stream.recv_message(), TIMEOUT_S)
        assert batch is not None, "the stream ended"
        assert batch.HasField("load")
        if batch.load.load_only == load_only:
            return batch


async def read_snapshot(stream: Any) -> tuple[int, dict[int, tuple[int, ...]]]:
    """The snapshot's chunks -> (its last number, hash -> tokens)."""
    blocks: dict[int, tuple[int, ...]] = {}
    chunk = await next_batch(stream)
    assert chunk.HasField("snapshot")
    assert chunk.snapshot.index == 0
    assert chunk.events[0].WhichOneof("data") == "cleared"
    apply(blocks, chunk)
    while chunk.snapshot.index + 1 < chunk.snapshot.count:
        following = await next_batch(stream)
        assert following.sequence_number == chunk.sequence_number + 1
        chunk = following
        apply(blocks, chunk)
    assert len(blocks) == chunk.snapshot.blocks
    return chunk.sequence_number, blocks


def apply(blocks: dict[int, tuple[int, ...]], batch: Any) -> None:
    for event in batch.events:
        kind = event.WhichOneof("data")
        if kind == "stored":
            for block in event.stored.blocks:
                assert block.block_size == BLOCK_SIZE
                assert len(block.token_ids) == BLOCK_SIZE
                blocks[block.block_hash] = tuple(block.token_ids)
        elif kind == "removed":
            for block_hash in event.removed.block_hashes:
                blocks.pop(block_hash, None)
        else:
            blocks.clear()


async def generate(server: RunningServer, prompt: list[int]) -> None:
    host, port = server.target.rsplit(":", 1)
    channel = Channel(host, int(port))
    try:
        request = pb.GenerateRequest(
            request_id=f"kv-{id(prompt)}-{prompt[0]}", tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=2), stream=False)
        await VllmClient(channel).generate_all(request, time_limit=TIMEOUT_S)
    finally:
        channel.close()


def prompt_of(seed: int, num_blocks: int = 4) -> list[int]:
    return [100 + (seed * 31 + i * 7) % 200 for i in range(num_blocks * BLOCK_SIZE + 3)]


def blocks_of(prompt: list[int]) -> set[tuple[int, ...]]:
    full = len(prompt) // BLOCK_SIZE
    return {tuple(prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]) for i in range(full)}


async def collect_until(stream: Any, blocks: dict[int, tuple[int, ...]], last: int,
                        wanted: set[tuple[int, ...]]) -> int:
    """Applies batches (numbered without gaps after `last`) until `wanted` blocks are all there."""
    while not wanted <= set(blocks.values()):
        batch = await next_batch(stream)
        assert batch.sequence_number == last + 1, "a gap or a repeat"
        assert batch.load.max_running_requests == 8
        last = batch.sequence_number
        apply(blocks, batch)
    return last


async def test_stream_snapshot_then_numbered_batches_for_several_subscribers(server: RunningServer) -> None:
    async with subscribe(server) as first, subscribe(server) as second:
        # 1) a load record numbered 0 first (smg asks for them), then the snapshot
        for stream in (first, second):
            heartbeat = await next_batch(stream, load_only=True)
            assert heartbeat.sequence_number == 0
            assert not heartbeat.events
        (last1, blocks1), (last2, blocks2) = await read_snapshot(first), await read_snapshot(second)
        # 2) a prompt's full blocks reach both, in batches numbered without gaps
        prompt = prompt_of(1)
        await generate(server, prompt)
        last1 = await collect_until(first, blocks1, last1, blocks_of(prompt))
        last2 = await collect_until(second, blocks2, last2, blocks_of(prompt))
        assert blocks1 == blocks2


async def test_resume_from_a_cursor_replays_what_was_missed(server: RunningServer) -> None:
    async with subscribe(server) as watcher:  # keeps the frontends subscribed meanwhile
        async with subscribe(server) as stream:
            last, blocks = await read_snapshot(stream)
        # 1) away: the cache changes
        prompt = prompt_of(2)
        await generate(server, prompt)
        # 2) back with the cursor: the batches after it, nothing before, no gap (on whichever worker)
        async with subscribe(server, last) as stream:
            last = await collect_until(stream, blocks, last, blocks_of(prompt))
        del watcher


async def test_cursors_the_server_cannot_serve_are_out_of_range(server: RunningServer) -> None:
    async with subscribe(server) as stream:
        last, _ = await read_snapshot(stream)
    for cursor in (last + 1000, 5):  # from the future; from another instance (a restart)
        with pytest.raises(GRPCError) as info:
            async with subscribe(server, cursor) as stream:
                await next_batch(stream)
        assert info.value.status is Status.OUT_OF_RANGE


async def test_cancelled_streams_leave_nothing_behind(server: RunningServer) -> None:
    for _ in range(5):
        async with subscribe(server) as stream:
            await read_snapshot(stream)
    async with subscribe(server) as stream:  # still served at once
        await read_snapshot(stream)
    assert "Traceback" not in server.log()


async def test_flush_cache_reaches_subscribers_as_a_cleared_event(server: RunningServer) -> None:
    async with subscribe(server) as stream:
        last, blocks = await read_snapshot(stream)
        prompt = prompt_of(3)
        await generate(server, prompt)
        last = await collect_until(stream, blocks, last, blocks_of(prompt))
        host, port = server.target.rsplit(":", 1)
        channel = Channel(host, int(port))
        try:
            reply = await VllmClient(channel).unary("FlushCache", common_pb2.FlushCacheRequest(timeout_s=0.0),
                                                    common_pb2.FlushCacheResponse, time_limit=TIMEOUT_S)
            assert reply.success
        finally:
            channel.close()
        while blocks:
            batch = await next_batch(stream)
            assert batch.sequence_number == last + 1
            last = batch.sequence_number
            apply(blocks, batch)
        assert any(event.WhichOneof("data") == "cleared" for event in batch.events)
