"""api/fast_path.py: a buffered Generate call without deadline is served by the fast path with the results,
errors, metrics, API-key check and cancellation of grpclib's request_handler; anything else goes to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import apiutil
import pytest
from apiutil import CALL_TIMEOUT_S, completion_ids, greedy_request
from engine_server.api.config import ServerConfig
from engine_server.api.handle import EngineHandle
from engine_server.api.security.config import SecurityConfig
from engine_server.api.server import EngineServer
from engine_server.engine.config import EngineConfig
from fakes import FakeEngine
from grpclib.const import Status
from grpclib.exceptions import GRPCError

API_KEY = "fast-path-test-key-0123456789"


class Harness(apiutil.Harness):
    @property
    def num_fast(self) -> int:
        return self.server._server.guard_stats.num_fast_path_calls

    def count(self, code: str) -> float:
        metrics = self.server.metrics
        assert metrics is not None
        sample: Callable[[str, dict[str, str]], Any] = metrics.registry.get_sample_value
        return sample("engine_requests_total", {"rpc": "Generate", "code": code}) or 0.0


async def _harness(*, api_key: str | None = None, max_size: int = 4 << 20) -> Harness:
    engine = FakeEngine()
    engine.gate.set()

    async def start_engine() -> EngineHandle:
        return engine

    security = SecurityConfig(api_key=api_key, max_receive_message_size=max_size)
    config = ServerConfig(port=0, metrics_port=0, drain_timeout_s=5.0, security=security)
    server = EngineServer(config, engine_config=EngineConfig(model="/fake/model"), start_engine=start_engine)
    await server.start()
    return Harness(server, engine)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = await _harness()
    yield h
    h.channel.close()
    await h.server.close()


async def _until_fast(call: Callable[[], Any], harness: Harness, *, tries: int = 10) -> Any:
    """`call()` until one took the fast path (a client may send its DATA after the HEADERS were dispatched:
    that call rightly takes grpclib's path)."""
    before = harness.num_fast
    for _ in range(tries):
        result = await call()
        if harness.num_fast > before:
            return result
    raise AssertionError(f"no fast-path call in {tries} tries")


async def test_fast_and_grpclib_paths_give_the_same_responses_and_metrics(harness: Harness) -> None:
    for stream in (True, False):
        request = greedy_request([5, 6], max_tokens=3, stream=stream, request_id=f"same-{stream}")
        fast = await _until_fast(lambda request=request: harness.stub.Generate(request), harness)  # type: ignore[misc]
        before = harness.num_fast
        slow = await harness.stub.Generate(request, timeout=CALL_TIMEOUT_S)  # a deadline: grpclib's path
        assert harness.num_fast == before
        assert [m.SerializeToString() for m in fast] == [m.SerializeToString() for m in slow]
        assert completion_ids(fast) == [7, 8, 9]
    assert harness.count("OK") >= 4  # the metrics listener counted the fast calls too


async def test_errors_are_the_same_on_both_paths(harness: Harness) -> None:
    statuses = []
    for timeout in (None, CALL_TIMEOUT_S):
        with pytest.raises(GRPCError) as caught:
            await harness.stub.Generate(greedy_request([10_000]), timeout=timeout)  # outside the vocabulary
        statuses.append((caught.value.status, caught.value.message))
    assert statuses[0] == statuses[1]
    assert statuses[0][0] == Status.INVALID_ARGUMENT
    assert harness.count("INVALID_ARGUMENT") == 2


async def test_an_oversized_request_takes_grpclibs_path_and_is_refused() -> None:
    h = await _harness(max_size=64)
    try:
        before = h.num_fast
        with pytest.raises(GRPCError) as caught:
            await h.stub.Generate(greedy_request(list(range(5, 200))))
        assert caught.value.status == Status.RESOURCE_EXHAUSTED
        assert h.num_fast == before
        small = greedy_request([5], max_tokens=1)
        await _until_fast(lambda: h.stub.Generate(small), h)  # small requests still take it
    finally:
        h.channel.close()
        await h.server.close()


async def test_the_api_key_is_checked_on_the_fast_path() -> None:
    h = await _harness(api_key=API_KEY)
    try:
        request = greedy_request([5], max_tokens=2)
        good = {"authorization": f"Bearer {API_KEY}"}
        responses = await _until_fast(lambda: h.stub.Generate(request, metadata=good), h)
        assert completion_ids(responses) == [6, 7]
        before = h.num_fast
        for metadata in ({}, {"authorization": "Bearer wrong"}):
            with pytest.raises(GRPCError) as caught:
                await h.stub.Generate(request, metadata=metadata)
            assert caught.value.status == Status.UNAUTHENTICATED
        assert h.num_fast > before  # refused on the fast path, not by falling back
        assert h.count("UNAUTHENTICATED") == 2
    finally:
        h.channel.close()
        await h.server.close()


async def test_a_cancelled_fast_call_aborts_the_engine_request(harness: Harness) -> None:
    for _ in range(10):
        harness.engine.gate.clear()
        before_fast, before_cancelled = harness.num_fast, harness.engine.num_cancelled
        async with harness.stub.Generate.open() as call:
            await call.send_message(greedy_request([5], max_tokens=10), end=True)
            assert await call.recv_message() is not None
            await call.cancel()
        for _ in range(100):  # the RST_STREAM reaches the handler asynchronously
            if harness.engine.num_cancelled > before_cancelled:
                break
            await asyncio.sleep(0.01)
        assert harness.engine.num_cancelled == before_cancelled + 1
        assert not harness.engine.in_flight
        if harness.num_fast > before_fast:
            return
    raise AssertionError("no cancelled call took the fast path")


async def test_only_registered_methods_take_the_fast_path(harness: Harness) -> None:
    from engine_proto.engine.v1 import info_pb2

    before = harness.num_fast
    for _ in range(3):
        await harness.stub.GetLoad(info_pb2.GetLoadRequest())
    assert harness.num_fast == before



def _buffered(*frames: bytes, end: bool = True, max_size: int = 100) -> tuple[bytes | None, list[int], Any]:
    from types import SimpleNamespace

    from engine_server.api.fast_path import _buffered_request
    from grpclib.const import Cardinality
    from grpclib.protocol import Buffer

    acked: list[int] = []
    buffer = Buffer(acked.append)
    for frame in frames:
        buffer.add(frame, len(frame))
    if end:
        buffer.eof()
    stream = SimpleNamespace(buffer=buffer)
    method = SimpleNamespace(cardinality=Cardinality.UNARY_STREAM)
    return _buffered_request(stream, method, max_size), acked, buffer


def test_the_buffered_request_is_taken_only_when_complete_and_well_formed() -> None:
    message = b"\x00\x00\x00\x00\x03abc"
    assert _buffered(message)[:2] == (b"abc", [8])
    assert _buffered(message[:4], message[4:])[:2] == (b"abc", [4, 4])  # split over two DATA frames
    for frames, end, max_size in [
        ((message,), False, 100),  # the client has not ended the stream: it may still be sending
        ((message[:6],), True, 100),  # shorter than its prefix says
        ((message + message,), True, 100),  # two messages on a unary request
        ((b"\x01" + message[1:],), True, 100),  # compressed
        ((message,), True, 2),  # over the size limit
        ((), True, 100),  # no message at all
    ]:
        taken, acked, buffer = _buffered(*frames, end=end, max_size=max_size)
        assert taken is None
        assert acked == []  # left for grpclib's path, which reads (and refuses) it as before
        assert buffer._unacked.qsize() == len(frames) + end
