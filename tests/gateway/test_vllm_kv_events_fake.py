"""SubscribeKvEvents over the fake engine (FakeCacheCore publishes batches on demand): what a real engine
cannot make happen on cue. A subscriber that falls behind ends DATA_LOSS while another goes on; a cancelled
stream releases its subscription (the frontend leaves the core's events once none is left); a bad request
gets a clear status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from engine_server.api.vllm_compat import VllmCompatOptions, vllm_handlers
from engine_server.engine.kv_events import BlocksStored, CacheEvent
from fake_cache_events import INSTANCE_STARTED_US, FakeCacheCore
from fake_engine import FakeEngine
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server
from smg_grpc_proto.generated import common_pb2
from vllm_client import PREFIX

TIMEOUT_S = 10.0


@pytest.fixture
async def served(tokenizer_dir: Path) -> AsyncIterator[tuple[FakeEngine, Channel, int]]:
    engine = FakeEngine(tokenizer_dir)
    engine.cache_core = FakeCacheCore(max_pending=4, linger_s=0)
    engine.cache_events = engine.cache_core.hub
    options = VllmCompatOptions(served_model_name="fake", max_num_seqs=8)
    server = Server(vllm_handlers(engine, options=options))
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # grpclib has no accessor
    channel = Channel("127.0.0.1", port)
    try:
        yield engine, channel, port
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


def open_stream(channel: Channel) -> Any:
    return channel.request(PREFIX + "SubscribeKvEvents", Cardinality.UNARY_STREAM,
                           common_pb2.SubscribeKvEventsRequest, common_pb2.KvEventBatch, timeout=TIMEOUT_S)


def stored(seed: int) -> list[CacheEvent]:
    return [BlocksStored((seed,), None, (tuple(range(16)),), "")]


async def wait_for(condition: Any) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        while not condition():  # noqa: ASYNC110 - the hub has no event for it; a bounded poll
            await asyncio.sleep(0.01)


async def end_status(stream: Any) -> Status:
    """Reads a stream to its end; the status it ended with."""
    while await asyncio.wait_for(stream.recv_message(), TIMEOUT_S) is not None:
        pass
    with pytest.raises(GRPCError) as info:
        await stream.recv_trailing_metadata()
    return info.value.status


async def test_subscribers_that_fall_behind_end_data_loss_and_a_new_one_is_served(
        served: tuple[FakeEngine, Channel, int]) -> None:
    engine, channel, _ = served
    async with open_stream(channel) as first, open_stream(channel) as second:
        for stream in (first, second):
            await stream.send_message(common_pb2.SubscribeKvEventsRequest(), end=True)
            assert (await stream.recv_message()).HasField("snapshot")
        # a burst between two turns of the event loop: more batches than a subscription may hold unread (4)
        # (the hub's own test has one subscriber fall behind while another keeps up)
        for seed in range(1, 7):
            engine.cache_core.publish(stored(seed))
        assert await end_status(first) is Status.DATA_LOSS
        assert await end_status(second) is Status.DATA_LOSS
    await wait_for(lambda: engine.cache_events.num_subscriptions == 0)
    async with open_stream(channel) as again:  # smg resubscribes from 0: a snapshot, then the next batch
        await again.send_message(common_pb2.SubscribeKvEventsRequest(), end=True)
        snapshot = await again.recv_message()
        assert snapshot.HasField("snapshot")
        engine.cache_core.publish(stored(99))
        batch = await asyncio.wait_for(again.recv_message(), TIMEOUT_S)
        assert batch.sequence_number == snapshot.sequence_number + 1
        assert batch.events[0].stored.blocks[0].block_hash == 99
        await again.cancel()


async def test_a_cancelled_stream_releases_its_subscription(served: tuple[FakeEngine, Channel, int]) -> None:
    engine, channel, _ = served
    for _ in range(3):
        async with open_stream(channel) as stream:
            await stream.send_message(common_pb2.SubscribeKvEventsRequest(
                load_records_before_first_batch=True), end=True)
            heartbeat = await stream.recv_message()
            assert heartbeat.load.load_only
            assert heartbeat.sequence_number == 0
            assert (await stream.recv_message()).HasField("snapshot")
            await stream.cancel()
        await wait_for(lambda: engine.cache_events.num_subscriptions == 0)
    # each time the last stream left, the frontend left the core's events (linger 0 here)
    assert engine.cache_core.commands == [True, False] * 3


async def test_cursors_it_cannot_serve_are_out_of_range(served: tuple[FakeEngine, Channel, int]) -> None:
    _, channel, _ = served
    for cursor in (5, INSTANCE_STARTED_US + 1000):  # another instance's; from the future
        async with open_stream(channel) as stream:
            request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=cursor)
            await stream.send_message(request, end=True)
            with pytest.raises(GRPCError) as info:
                await stream.recv_message()
            assert info.value.status is Status.OUT_OF_RANGE
