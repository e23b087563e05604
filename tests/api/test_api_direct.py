"""Direct calls (transport/fast_path.py + StreamedGenerate.start_without_task): a streamed Generate without a
deadline is served with no task of its own on the real AsyncEngine (simulated core); it still gets every
token in order when the client reads slowly, and a reset, a dropped connection or a drain end it cleanly."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from apiutil import CALL_TIMEOUT_S, greedy_request
from engine_proto.engine.v1 import generate_pb2
from engine_server.api.config import ServerConfig
from engine_server.api.handle import EngineHandle
from engine_server.api.security.config import SecurityConfig
from engine_server.api.server import EngineServer
from engine_server.engine.config import EngineConfig
from engine_server.engine.simulated import simulated_engine_factory
from engine_server.frontend.async_engine import AsyncEngine
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import DataReceived, ResponseReceived, StreamEnded, StreamReset, TrailersReceived
from h2.settings import SettingCodes
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

GENERATE = "/engine.v1.EngineService/Generate"
VLLM_GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"
API_KEY = "direct-call-test-key-0123456789"
STEP_MS = 2.0


class Served:
    def __init__(self, server: EngineServer) -> None:
        self.server = server

    @property
    def engine(self) -> AsyncEngine:
        engine = self.server._engine
        assert isinstance(engine, AsyncEngine)
        return engine

    @property
    def num_direct(self) -> int:
        return self.server._server.guard_stats.num_direct_calls

    def count(self, code: str) -> float:
        metrics = self.server.metrics
        assert metrics is not None
        value = metrics.registry.get_sample_value("engine_requests_total", {"rpc": "Generate", "code": code})
        return value or 0.0

    async def wait_all_released(self) -> None:
        """Until nothing of any call is left: engine requests, streams under the limit, handlers in flight,
        direct calls, h2 streams."""
        for _ in range(500):
            handlers = list(self.server._server._handlers)
            if (not self.engine._requests and self.server._in_flight.count == 0
                    and self.server.servicer._stream_limit._num_streams == 0  # type: ignore[attr-defined]
                    and all(not h._direct for h in handlers)):  # type: ignore[attr-defined]
                return
            await asyncio.sleep(0.01)
        raise AssertionError("a call's resources were not released")


async def _serve(model_dir: Path, *, api_key: str | None = None) -> Served:
    engine_config = EngineConfig(model=str(model_dir), max_num_seqs=64)

    async def start_engine() -> EngineHandle:
        return await AsyncEngine.start(engine_config, in_process=True,
                                       engine_factory=simulated_engine_factory(STEP_MS))

    security = SecurityConfig(api_key=api_key)
    config = ServerConfig(port=0, metrics_port=0, drain_timeout_s=10.0, security=security)
    server = EngineServer(config, engine_config=engine_config, start_engine=start_engine)
    await server.start()
    return Served(server)


@pytest.fixture
async def served(tiny_model_dir: Path) -> AsyncIterator[Served]:
    s = await _serve(tiny_model_dir)
    yield s
    await s.server.close()


class RawClient:
    """engine.v1 Generate calls over plain h2: HEADERS and DATA of a call in one write (so a call always
    qualifies for the direct path), and the reading pace under the test's control."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 window: int | None) -> None:
        self._reader, self._writer = reader, writer
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding="ascii"))
        self.h2.initiate_connection()
        if window is not None:
            self.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.messages: dict[int, list[Any]] = {}
        self._response_types: dict[int, Any] = {}
        self.trailers: dict[int, dict[str, str]] = {}
        self._partial: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.resets: set[int] = set()

    @classmethod
    async def connect(cls, port: int, *, window: int | None = None) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer, window)

    def start(self, request: Any, *, metadata: tuple[tuple[str, str], ...] = (), path: str = GENERATE,
              response_type: Any = generate_pb2.GenerateResponse) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, [
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "test"),
            ("content-type", "application/grpc"), ("te", "trailers"), *metadata])
        self._response_types[stream_id] = response_type
        body = request.SerializeToString()
        self.h2.send_data(stream_id, struct.pack(">BI", 0, len(body)) + body, end_stream=True)
        self.messages[stream_id] = []
        self._flush()
        return stream_id

    def reset(self, stream_id: int) -> None:
        self.h2.reset_stream(stream_id, ErrorCodes.CANCEL)
        self._flush()

    def close(self) -> None:
        self._writer.close()

    async def read(self, *, ack: bool = True) -> None:
        """One read's worth of events; DATA is acknowledged (window credit) unless `ack` is False."""
        data = await asyncio.wait_for(self._reader.read(65536), CALL_TIMEOUT_S)
        assert data, "the server closed the connection"
        for event in self.h2.receive_data(data):
            if isinstance(event, DataReceived):
                self._on_data(event.stream_id, event.data)
                if ack:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, (ResponseReceived, TrailersReceived)):
                self.trailers.setdefault(event.stream_id, {}).update(
                    (str(name), str(value)) for name, value in event.headers)
            elif isinstance(event, StreamEnded):
                self.ended.add(event.stream_id)
            elif isinstance(event, StreamReset):
                self.resets.add(event.stream_id)
        self._flush()

    async def until(self, condition: Any, *, ack: bool = True) -> None:
        while not condition():
            await self.read(ack=ack)

    async def call(
        self, request: generate_pb2.GenerateRequest
    ) -> tuple[list[generate_pb2.GenerateResponse], str]:
        stream_id = self.start(request)
        await self.until(lambda: stream_id in self.ended)
        return self.messages[stream_id], self.trailers[stream_id]["grpc-status"]

    def _on_data(self, stream_id: int, data: bytes) -> None:
        buffered = self._partial.get(stream_id, b"") + data
        while len(buffered) >= 5:
            (size,) = struct.unpack(">I", buffered[1:5])
            if len(buffered) < 5 + size:
                break
            self.messages[stream_id].append(self._response_types[stream_id].FromString(buffered[5:5 + size]))
            buffered = buffered[5 + size:]
        self._partial[stream_id] = buffered

    def _flush(self) -> None:
        self._writer.write(self.h2.data_to_send())


def _tokens(messages: list[generate_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for c in m.completions for t in c.token_ids]


def _finish(messages: list[generate_pb2.GenerateResponse]) -> int:
    return messages[-1].completions[0].finish_reason


async def test_a_streamed_call_without_deadline_is_served_without_a_task(served: Served) -> None:
    client = await RawClient.connect(served.server.port)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            messages, status = await client.call(greedy_request([20, 21, 22], max_tokens=12, ignore_eos=True))
            assert status == "0"
            assert len(_tokens(messages)) == 12
            assert _finish(messages) == generate_pb2.FINISH_REASON_LENGTH
            assert messages[-1].usage.completion_tokens == 12
            assert served.num_direct == 1
            assert served.count("OK") == 1
            handler = next(iter(served.server._server._handlers))
            assert not handler._tasks  # no task was ever made for it
            await served.wait_all_released()
    finally:
        client.close()


async def test_the_same_tokens_as_on_a_task(served: Served) -> None:
    client = await RawClient.connect(served.server.port)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            request = greedy_request([20, 21, 22], max_tokens=9, ignore_eos=True)
            direct, _ = await client.call(request)
            with_deadline = client.start(request, metadata=(("grpc-timeout", "30S"),))
            await client.until(lambda: with_deadline in client.ended)
            # a unary Generate is served on a task
            whole, status = await client.call(greedy_request([20, 21, 22], max_tokens=9, ignore_eos=True,
                                                              stream=False))
            assert served.num_direct == 2
            assert (status, client.trailers[with_deadline]["grpc-status"]) == ("0", "0")
            assert _tokens(direct) == _tokens(client.messages[with_deadline]) == _tokens(whole)
            assert len(_tokens(direct)) == 9
    finally:
        client.close()


async def test_a_direct_call_past_its_deadline_ends_with_deadline_exceeded(served: Served) -> None:
    client = await RawClient.connect(served.server.port)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            stream_id = client.start(greedy_request([20], max_tokens=2000, ignore_eos=True),
                                     metadata=(("grpc-timeout", "300m"),))
            await client.until(lambda: stream_id in client.ended or stream_id in client.resets)
            assert client.trailers[stream_id]["grpc-status"] == str(4)  # DEADLINE_EXCEEDED
            assert 10 < len(_tokens(client.messages[stream_id])) < 2000  # it ran until the deadline
            assert served.num_direct == 1
            await served.wait_all_released()
            assert served.count("DEADLINE_EXCEEDED") == 1
            assert served.count("OK") == served.count("UNKNOWN") == 0
    finally:
        client.close()


async def test_a_client_that_reads_slowly_gets_every_token_in_order(served: Served) -> None:
    # A 40-byte window holds about one message: most pushes are declined, and the call moves to its task.
    client = await RawClient.connect(served.server.port, window=40)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            first = client.start(greedy_request([20, 21], max_tokens=30, ignore_eos=True))
            second = client.start(greedy_request([20, 21], max_tokens=30, ignore_eos=True))
            await client.read(ack=False)
            await asyncio.sleep(20 * STEP_MS / 1000)  # the engine runs on while the client is not reading
            await client.until(lambda: {first, second} <= client.ended)
            assert served.num_direct == 2
            for stream_id in (first, second):
                assert client.trailers[stream_id]["grpc-status"] == "0"
                assert len(_tokens(client.messages[stream_id])) == 30
            assert _tokens(client.messages[first]) == _tokens(client.messages[second])
            assert served.count("OK") == 2
            await served.wait_all_released()
    finally:
        client.close()


async def test_a_reset_direct_call_aborts_its_request(served: Served) -> None:
    client = await RawClient.connect(served.server.port)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            stream_id = client.start(greedy_request([20], max_tokens=2000, ignore_eos=True))
            await client.until(lambda: len(client.messages[stream_id]) >= 2)
            assert served.engine._requests  # running
            client.reset(stream_id)
            await served.wait_all_released()
            assert served.num_direct == 1
            assert served.count("CANCELLED") == 1
            # the connection serves on
            messages, status = await client.call(greedy_request([20], max_tokens=3, ignore_eos=True))
            assert (status, len(_tokens(messages))) == ("0", 3)
    finally:
        client.close()


async def test_a_dropped_connection_aborts_its_direct_calls(served: Served) -> None:
    client = await RawClient.connect(served.server.port)
    async with asyncio.timeout(CALL_TIMEOUT_S):
        ids = [client.start(greedy_request([20 + i], max_tokens=2000, ignore_eos=True)) for i in range(8)]
        await client.until(lambda: all(client.messages[i] for i in ids))
        client.close()
        await served.wait_all_released()
    assert served.num_direct == 8
    assert served.count("CANCELLED") == 8


async def test_an_abort_ends_a_direct_call_with_finish_reason_abort(served: Served) -> None:
    client = await RawClient.connect(served.server.port)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            request = greedy_request([20], max_tokens=2000, ignore_eos=True, request_id="abort-me")
            stream_id = client.start(request)
            await client.until(lambda: len(client.messages[stream_id]) >= 1)
            assert await served.engine.abort(["abort-me"]) == ["abort-me"]
            await client.until(lambda: stream_id in client.ended)
            assert client.trailers[stream_id]["grpc-status"] == "0"
            assert _finish(client.messages[stream_id]) == generate_pb2.FINISH_REASON_ABORT
            await served.wait_all_released()
            assert served.count("OK") == 1
    finally:
        client.close()


async def test_a_drain_lets_direct_calls_finish(served: Served) -> None:
    client = await RawClient.connect(served.server.port)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            stream_id = client.start(greedy_request([20], max_tokens=60, ignore_eos=True))
            await client.until(lambda: len(client.messages[stream_id]) >= 1)
            draining = asyncio.create_task(served.server.drain())
            await client.until(lambda: stream_id in client.ended)
            assert client.trailers[stream_id]["grpc-status"] == "0"
            assert len(_tokens(client.messages[stream_id])) == 60
            await draining
    finally:
        client.close()


async def test_the_api_key_is_checked_before_a_direct_call(tiny_model_dir: Path) -> None:
    served = await _serve(tiny_model_dir, api_key=API_KEY)
    client = await RawClient.connect(served.server.port)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            request = greedy_request([20], max_tokens=3, ignore_eos=True)
            good = client.start(request, metadata=(("authorization", f"Bearer {API_KEY}"),))
            bad = client.start(request, metadata=(("authorization", "Bearer wrong"),))
            await client.until(lambda: {good, bad} <= client.ended)
            assert client.trailers[good]["grpc-status"] == "0"
            assert client.trailers[bad]["grpc-status"] == str(16)  # UNAUTHENTICATED
            assert served.num_direct == 1
            assert served.count("OK") == served.count("UNAUTHENTICATED") == 1
            assert served.server._server.guard_stats is not None
    finally:
        client.close()
        await served.server.close()


async def test_a_direct_call_that_took_its_task_keeps_its_deadline(served: Served) -> None:
    client = await RawClient.connect(served.server.port, window=40)  # pushes are declined: the call's task
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            stream_id = client.start(greedy_request([20], max_tokens=2000, ignore_eos=True),
                                     metadata=(("grpc-timeout", "400m"),))
            await client.until(lambda: stream_id in client.ended or stream_id in client.resets)
            assert client.trailers[stream_id]["grpc-status"] == str(4)  # DEADLINE_EXCEEDED
            assert served.num_direct == 1
            await served.wait_all_released()
            assert served.count("DEADLINE_EXCEEDED") == 1
    finally:
        client.close()


def _vllm_request(prompt: list[int], max_tokens: int, request_id: str = "") -> Any:
    return vllm_pb.GenerateRequest(
        request_id=request_id, tokenized=vllm_pb.TokenizedInput(input_ids=prompt), stream=True,
        sampling_params=vllm_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def _vllm_tokens(messages: list[Any]) -> list[int]:
    return [t for m in messages if m.WhichOneof("response") == "chunk" for t in m.chunk.token_ids]


async def test_the_vllm_protocols_streamed_generate_is_a_direct_call_too(served: Served) -> None:
    client = await RawClient.connect(served.server.port)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            stream_id = client.start(_vllm_request([20, 21, 22], 12), path=VLLM_GENERATE,
                                     response_type=vllm_pb.GenerateResponse)
            await client.until(lambda: stream_id in client.ended)
            messages = client.messages[stream_id]
            assert client.trailers[stream_id]["grpc-status"] == "0"
            assert [m.WhichOneof("response") for m in messages][-1] == "complete"
            assert len(_vllm_tokens(messages)) == 12
            assert list(messages[-1].complete.output_ids) == _vllm_tokens(messages)
            assert messages[-1].complete.finish_reason == "length"
            assert served.num_direct == 1
            handler = next(iter(served.server._server._handlers))
            assert not handler._tasks  # no task was ever made for it
            await served.wait_all_released()
            # the same tokens as engine.v1's Generate (same engine, same prompt, greedy)
            v1, _ = await client.call(greedy_request([20, 21, 22], max_tokens=12, ignore_eos=True))
            assert _tokens(v1) == _vllm_tokens(messages)
    finally:
        client.close()


async def test_a_slow_vllm_client_gets_every_token_and_a_reset_aborts(served: Served) -> None:
    client = await RawClient.connect(served.server.port, window=60)  # pushes are declined: the call's task
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            slow = client.start(_vllm_request([20, 21], 40), path=VLLM_GENERATE,
                                response_type=vllm_pb.GenerateResponse)
            endless = client.start(_vllm_request([30], 2000), path=VLLM_GENERATE,
                                   response_type=vllm_pb.GenerateResponse)
            await client.read(ack=False)
            await asyncio.sleep(20 * STEP_MS / 1000)
            await client.until(lambda: slow in client.ended and len(client.messages[endless]) >= 2)
            assert client.trailers[slow]["grpc-status"] == "0"
            assert len(_vllm_tokens(client.messages[slow])) == 40
            client.reset(endless)
            await served.wait_all_released()
            assert served.num_direct == 2
            assert served.count("OK") == served.count("CANCELLED") == 1
    finally:
        client.close()
