"""--max-concurrent-streams counts engine.v1 and vllm.grpc.engine.VllmEngine (smg gateway) Generate streams
together: one limit, either kind refused when it is reached, every slot back however a stream ends.

In process on the fake engine (api/server.py assembles both services on one port), so fast.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from apiutil import greedy_request
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_server.api.config import ServerConfig
from engine_server.api.handle import EngineHandle
from engine_server.api.server import EngineServer
from engine_server.api.stream_limit import LocalStreamLimit
from engine_server.api.transport.fast_send import FastSender
from engine_server.engine.config import EngineConfig
from fakes import FakeEngine
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

LIMIT = 3
TIMEOUT_S = 10.0  # every call and wait: a stream admitted by mistake fails the test, not hangs it
VLLM_GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"


@dataclass
class Harness:
    server: EngineServer
    engine: FakeEngine
    channel: Channel

    def engine_v1(self) -> Any:
        """An engine.v1 Generate call, not yet opened."""
        return EngineServiceStub(self.channel).Generate.open(timeout=TIMEOUT_S)

    def vllm(self) -> Any:
        """A vLLM Generate call, not yet opened."""
        return self.channel.request(VLLM_GENERATE, Cardinality.UNARY_STREAM, vllm_pb.GenerateRequest,
                                    vllm_pb.GenerateResponse, timeout=TIMEOUT_S)


def _vllm_request(request_id: str, *, max_tokens: int = 2) -> vllm_pb.GenerateRequest:
    return vllm_pb.GenerateRequest(
        request_id=request_id, tokenized=vllm_pb.TokenizedInput(input_ids=[5]), stream=True,
        sampling_params=vllm_pb.SamplingParams(max_tokens=max_tokens),
    )


async def _open(call: Any, request: Any) -> Any:
    """Opens `call` and waits for its first message: the server admitted the stream."""
    await call.__aenter__()
    await call.send_message(request, end=True)
    assert await call.recv_message() is not None
    return call


async def _call(call: Any, request: Any) -> None:
    async with call:
        await call.send_message(request, end=True)
        await call.recv_message()


async def _refused(call: Any, request: Any) -> GRPCError:
    with pytest.raises(GRPCError) as caught:
        await _call(call, request)
    return caught.value


async def _until(predicate: Callable[[], bool]) -> None:
    """Bounded wait for the server to notice a client-side event (an RST_STREAM arrives asynchronously)."""
    for _ in range(int(TIMEOUT_S / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server did not notice in time")


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    engine = FakeEngine()

    async def start_engine() -> EngineHandle:
        return engine

    config = ServerConfig(port=0, metrics_port=None, max_concurrent_streams=LIMIT)
    server = EngineServer(config, engine_config=EngineConfig(model="/fake/model"), start_engine=start_engine)
    await server.start()
    channel = Channel("127.0.0.1", server.port)
    try:
        yield Harness(server, engine, channel)
    finally:
        channel.close()
        await server.close()


async def test_both_kinds_count_against_one_limit(harness: Harness) -> None:
    harness.engine.gate.clear()  # every stream stays in flight after its first message
    held = [
        await _open(harness.engine_v1(), greedy_request([5], max_tokens=2)),
        await _open(harness.vllm(), _vllm_request("v1")),
        await _open(harness.engine_v1(), greedy_request([5], max_tokens=2)),
    ]
    assert len(held) == LIMIT
    refused_vllm = await _refused(harness.vllm(), _vllm_request("v2"))
    assert refused_vllm.status == Status.RESOURCE_EXHAUSTED
    assert f"too many concurrent streams ({LIMIT})" in (refused_vllm.message or "")
    refused_v1 = await _refused(harness.engine_v1(), greedy_request([5]))
    assert refused_v1.status == Status.RESOURCE_EXHAUSTED
    assert not any(r.request_id == "vllm:v2" for r in harness.engine.requests)  # refused before the engine

    # a normal end gives the slot back, to either kind
    harness.engine.gate.set()
    for call in held:
        assert [m async for m in call]
        await call.__aexit__(None, None, None)
    harness.engine.gate.clear()
    held = [await _open(harness.vllm(), _vllm_request(f"again-{i}")) for i in range(LIMIT)]
    assert (await _refused(harness.engine_v1(), greedy_request([5]))).status == Status.RESOURCE_EXHAUSTED
    harness.engine.gate.set()
    for call in held:
        assert [m async for m in call]
        await call.__aexit__(None, None, None)


async def test_a_vllm_slot_comes_back_after_an_error_or_a_cancel(harness: Harness) -> None:
    engine = harness.engine
    # 1) the engine refuses the request (at generate()) and fails one mid-stream (an error output)
    engine.fail_with = RuntimeError("boom")
    for i in range(LIMIT + 1):
        assert (await _refused(harness.vllm(), _vllm_request(f"fail-{i}"))).status == Status.INTERNAL
    engine.fail_with = None
    engine.error_text = "the engine failed this request"
    for i in range(LIMIT + 1):
        assert (await _refused(harness.vllm(), _vllm_request(f"err-{i}"))).status == Status.INTERNAL
    engine.error_text = None
    # 2) an invalid request
    invalid = _vllm_request("bad")
    invalid.sampling_params.temperature = -1.0
    for _ in range(LIMIT + 1):
        assert (await _refused(harness.vllm(), invalid)).status == Status.INVALID_ARGUMENT
    # 3) client cancels (RST_STREAM): the handler is cancelled, the engine stream closed
    engine.gate.clear()
    for i in range(LIMIT + 1):
        call = await _open(harness.vllm(), _vllm_request(f"cancel-{i}", max_tokens=10))
        await call.cancel()
        with contextlib.suppress(GRPCError):
            await call.__aexit__(None, None, None)
        await _until(lambda: not engine.in_flight)
    engine.gate.set()
    # every slot is free
    engine.gate.clear()
    held = [await _open(harness.vllm(), _vllm_request(f"full-{i}")) for i in range(LIMIT)]
    assert (await _refused(harness.vllm(), _vllm_request("over"))).status == Status.RESOURCE_EXHAUSTED
    engine.gate.set()
    for call in held:
        assert [m async for m in call]
        await call.__aexit__(None, None, None)


class _RecordingLimit(LocalStreamLimit):
    """The server's limit, noting each give-back in the log the trailer writes go to."""

    def __init__(self, limit: int, log: list[str]) -> None:
        super().__init__(limit)
        self._log = log

    def release(self) -> None:
        self._log.append("release")
        super().release()


@pytest.mark.parametrize("kind", ["engine_v1", "vllm"])
async def test_the_slot_is_free_before_the_end_leaves(
    harness: Harness, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The push path writes a call's end from the engine's output task, before the handler returns: a client
    that opens its next stream the moment it reads the end (as a gateway does, on any frontend) must find the
    place free, so the slot goes back before the trailers are written."""
    log: list[str] = []
    harness.server.use_stream_limit(_RecordingLimit(LIMIT, log))
    write_headers = FastSender._try_send_headers

    def recording_write(sender: FastSender, block: bytes, *, end_stream: bool) -> bool:
        written = write_headers(sender, block, end_stream=end_stream)
        if written and end_stream:
            log.append("end")
        return written

    monkeypatch.setattr(FastSender, "_try_send_headers", recording_write)
    for index in range(LIMIT + 1):
        log.clear()
        if kind == "engine_v1":
            call, request = harness.engine_v1(), greedy_request([5], max_tokens=3)
        else:
            call, request = harness.vllm(), _vllm_request(f"end-{index}", max_tokens=3)
        async with call:
            await call.send_message(request, end=True)
            assert [message async for message in call]
        assert log == ["release", "end"]  # once each: the fast path ended the call, after the give-back
