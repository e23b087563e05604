"""cache_salt, priority and FlushCache on a real server with --api-workers 2, through engine.v1 and the
vLLM-compatible service: one engine core serves both frontends, so a flush through one empties the cache the
other's requests see, and running streams finish unchanged."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
from apiutil import CALL_TIMEOUT_S, completion_ids, greedy_request
from engine_proto.engine.v1 import cache_pb2, generate_pb2, info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from serverproc import RunningServer, connection_owner, start_server
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

VLLM = "/vllm.grpc.engine.VllmEngine/"
CACHED = 32  # a 40-token prompt: two full blocks of 16 can come from the cache (the last token never does)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with start_server("--api-workers", "2") as running:
        yield running


async def _channel_to(server: RunningServer, pid: int) -> Channel:
    """A channel served by frontend `pid` once it serves (the kernel picks the frontend per connection)."""
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while time.monotonic() < deadline:
        channel = Channel("127.0.0.1", server.port)
        load = await EngineServiceStub(channel).GetLoad(info_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)
        if connection_owner(channel) == pid and load.state == info_pb2.ENGINE_STATE_SERVING:
            return channel
        channel.close()
        await asyncio.sleep(0.02)  # NOTE: polls another process's start, bounded by the deadline
    raise AssertionError(f"no connection reached frontend {pid} within {CALL_TIMEOUT_S} s")


@pytest.fixture
async def channels(server: RunningServer) -> AsyncIterator[tuple[Channel, Channel]]:
    """A channel to the primary frontend and one to the worker frontend."""
    (worker,) = server.pids_named("engine-api-1")
    primary = await _channel_to(server, server.process.pid)
    try:
        to_worker = await _channel_to(server, worker)
    except BaseException:
        primary.close()
        raise
    try:
        yield primary, to_worker
    finally:
        primary.close()
        to_worker.close()


@pytest.fixture
def stubs(channels: tuple[Channel, Channel]) -> tuple[EngineServiceStub, EngineServiceStub]:
    """engine.v1 stubs on the primary frontend and on the worker frontend."""
    return EngineServiceStub(channels[0]), EngineServiceStub(channels[1])


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(40)]


def _request(prompt: Sequence[int], *, salt: str = "", priority: int = 0, max_tokens: int = 4,
             stream: bool = False) -> generate_pb2.GenerateRequest:
    request = greedy_request(prompt, max_tokens=max_tokens, stream=stream, ignore_eos=True)
    request.cache_salt = salt
    request.priority = priority
    return request


async def _cached(stub: EngineServiceStub, prompt: Sequence[int], salt: str = "") -> int:
    (response,) = await stub.Generate(_request(prompt, salt=salt), timeout=CALL_TIMEOUT_S)
    return response.usage.cached_prompt_tokens


async def test_salts_isolate_the_prefix_cache_across_frontends(
    stubs: tuple[EngineServiceStub, EngineServiceStub],
) -> None:
    primary, worker = stubs
    prompt = _prompt(1)
    assert await _cached(primary, prompt, "tenant-a") == 0
    assert await _cached(worker, prompt, "tenant-b") == 0  # another tenant learns nothing
    assert await _cached(worker, prompt) == 0  # nor does the shared namespace
    assert await _cached(worker, prompt, "tenant-a") == CACHED  # the same tenant, on the other frontend
    assert await _cached(primary, prompt, "tenant-b") == CACHED


async def test_a_salt_over_its_bound_is_invalid_argument(
    stubs: tuple[EngineServiceStub, EngineServiceStub],
) -> None:
    with pytest.raises(GRPCError) as info:
        await stubs[1].Generate(_request(_prompt(2), salt="s" * 257), timeout=CALL_TIMEOUT_S)
    assert info.value.status is Status.INVALID_ARGUMENT
    assert "cache_salt" in (info.value.message or "")


async def test_priority_changes_no_tokens(stubs: tuple[EngineServiceStub, EngineServiceStub]) -> None:
    prompt = _prompt(3)
    outputs = []
    for priority in (-(2**31), 0, 2**31 - 1):
        responses = await stubs[0].Generate(_request(prompt, priority=priority, max_tokens=8),
                                            timeout=CALL_TIMEOUT_S)
        outputs.append(completion_ids(responses))
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0]) == 8


async def test_engine_v1_flush_keeps_a_running_stream_and_drops_its_blocks(
    stubs: tuple[EngineServiceStub, EngineServiceStub],
) -> None:
    primary, worker = stubs
    prompt = _prompt(4)
    reference = completion_ids(await primary.Generate(_request(prompt, salt="ref", max_tokens=48),
                                                      timeout=CALL_TIMEOUT_S))
    assert await _cached(worker, prompt) == 0  # now cached in the shared namespace too
    async with primary.Generate.open(timeout=CALL_TIMEOUT_S) as stream:
        await stream.send_message(_request(prompt, max_tokens=48, stream=True), end=True)
        first = await stream.recv_message()  # its prompt is computed (and cached) by now
        assert first is not None
        # The flush goes through the other frontend: the core is one for both.
        flushed = await worker.FlushCache(cache_pb2.FlushCacheRequest(), timeout=CALL_TIMEOUT_S)
        assert flushed.num_blocks_flushed >= 2
        responses = [first]
        while (message := await stream.recv_message()) is not None:
            responses.append(message)
    assert completion_ids(responses) == reference
    assert responses[-1].usage.cached_prompt_tokens == CACHED  # admitted before the flush, from the cache
    assert await _cached(primary, prompt) == 0
    assert await _cached(primary, prompt, "ref") == 0
    assert await _cached(worker, prompt) == CACHED  # and the cache fills again


async def _vllm_generate(channel: Channel, request_id: str, prompt: Sequence[int], *,
                         max_tokens: int) -> list[Any]:
    request = vllm_pb.GenerateRequest(
        request_id=request_id, tokenized=vllm_pb.TokenizedInput(input_ids=list(prompt)), stream=True,
        sampling_params=vllm_pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    async with channel.request(VLLM + "Generate", Cardinality.UNARY_STREAM, vllm_pb.GenerateRequest,
                               vllm_pb.GenerateResponse, timeout=CALL_TIMEOUT_S) as stream:
        await stream.send_message(request, end=True)
        messages = []
        while (message := await stream.recv_message()) is not None:
            messages.append(message)
            if len(messages) == 1:  # while it runs, flush through the same connection's other service
                messages.append(await _vllm_flush(channel, timeout_s=0.0))
    return messages


async def _vllm_flush(channel: Channel, *, timeout_s: float) -> common_pb2.FlushCacheResponse:
    async with channel.request(VLLM + "FlushCache", Cardinality.UNARY_UNARY, common_pb2.FlushCacheRequest,
                               common_pb2.FlushCacheResponse, timeout=CALL_TIMEOUT_S) as stream:
        await stream.send_message(common_pb2.FlushCacheRequest(timeout_s=timeout_s), end=True)
        reply: common_pb2.FlushCacheResponse | None = await stream.recv_message()
        await stream.recv_trailing_metadata()
    assert reply is not None
    return reply


async def test_vllm_flush_keeps_a_running_stream_and_drops_its_blocks(
    channels: tuple[Channel, Channel], stubs: tuple[EngineServiceStub, EngineServiceStub],
) -> None:
    primary, worker = stubs
    prompt = _prompt(5)
    responses = await primary.Generate(_request(prompt, max_tokens=32), timeout=CALL_TIMEOUT_S)
    reference = completion_ids(responses)
    channel = channels[0]
    messages = await _vllm_generate(channel, "v1", prompt, max_tokens=32)
    flush_reply = messages.pop(1)
    assert flush_reply.success, flush_reply.message
    assert flush_reply.message.startswith("flushed ")
    complete = messages[-1].complete
    assert list(complete.output_ids) == reference
    assert complete.cached_tokens == CACHED  # admitted from the cache, before the flush
    assert await _cached(worker, prompt) == 0
    reply = await _vllm_flush(channel, timeout_s=30.0)
    assert reply.success


async def test_vllm_flush_with_a_negative_timeout_is_invalid(channels: tuple[Channel, Channel]) -> None:
    with pytest.raises(GRPCError) as info:
        await _vllm_flush(channels[1], timeout_s=-1.0)
    assert info.value.status is Status.INVALID_ARGUMENT
