"""The vLLM-compatible Generate's push path: the engine's output task offers each output to the call's sink,
which writes its messages in place (the last one with the OK trailers) without waking the handler; what it
cannot write whole, and every failure, comes back through the iterator and is sent or raised as before."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from engine_server.api.metrics import ServerMetrics
from engine_server.api.transport.fast_send import FastSender
from engine_server.api.vllm_compat import VllmEngineServicer
from engine_server.api.vllm_compat.output_writer import OutputWriter
from engine_server.api.vllm_compat.responses import ResponseBuilder
from engine_server.engine.types import FinishReason
from engine_server.frontend.outputs import CompletionChunk, GenerateOutput, GenerateRequest, OutputSink
from fake_engine import FakeEngine
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from vllm_client import VllmClient

DEADLINE_S = 10.0
PROMPT = (1, 5, 6)
BIG_TOKEN_ID = 20_000  # a 3-byte varint: 6000 of them make a `complete` larger than one 16 KiB frame


def make_output(
    token_ids: list[int], *, finish: FinishReason | None = None, error: str | None = None,
    num_tokens: int = 0,
) -> GenerateOutput:
    chunk = CompletionChunk(0, token_ids, "", None, finish, None, num_tokens)
    return GenerateOutput("scripted", [chunk], len(PROMPT), 0, None, finish is not None, error)


class ScriptedStream:
    """Offers its script to the sink once the handler sets one (from the loop, as the engine's output task
    would), nothing while a declined output waits (as RequestState does); yields the declined outputs, then
    keeps the handler parked until `release` is set."""

    def __init__(self, script: list[GenerateOutput], release: asyncio.Event) -> None:
        self._script = script
        self._release = release
        self._declined: deque[GenerateOutput] = deque()
        self._is_offered = asyncio.Event()
        self.verdicts: list[bool | None] = []  # per output: the sink's answer; None: not offered

    def set_sink(self, sink: OutputSink | None) -> None:
        if sink is not None and not self._is_offered.is_set():
            asyncio.get_running_loop().call_soon(self._offer_all, sink)

    def _offer_all(self, sink: OutputSink) -> None:
        for output in self._script:
            if self._declined:
                self.verdicts.append(None)
                self._declined.append(output)
                continue
            delivered = sink(output)
            self.verdicts.append(delivered)
            if not delivered:
                self._declined.append(output)
        self._is_offered.set()

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> GenerateOutput:
        await self._is_offered.wait()
        if self._declined:
            return self._declined.popleft()
        await self._release.wait()
        raise StopAsyncIteration

    def set_ready_callback(self, callback: object) -> bool:
        return False  # the handler's task iterates (a direct call takes its task at once)

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class ScriptedEngine(FakeEngine):
    def __init__(self, tokenizer_dir: Path, script: list[GenerateOutput]) -> None:
        super().__init__(tokenizer_dir)
        self.script = script
        self.release = asyncio.Event()
        self.scripted: list[ScriptedStream] = []

    def generate(self, request: GenerateRequest) -> Any:
        stream = ScriptedStream(self.script, self.release)
        self.scripted.append(stream)
        return stream


@dataclass
class Harness:
    engine: ScriptedEngine
    client: VllmClient
    metrics: ServerMetrics

    async def call(self, *, stream: bool, **params: Any) -> tuple[list[Any], GRPCError | None]:
        """Every message of one Generate call and its error (None: it ended OK)."""
        request = pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                     stream=stream,
                                     sampling_params=pb.SamplingParams(max_tokens=100, **params))
        messages: list[Any] = []
        async with asyncio.timeout(DEADLINE_S), self.client.generate(request) as call:
            await call.send_message(request, end=True)
            try:
                while (message := await call.recv_message()) is not None:
                    messages.append(message)
                await call.recv_trailing_metadata()
            except GRPCError as exc:
                return messages, exc
        return messages, None

    @property
    def verdicts(self) -> list[bool | None]:
        (stream,) = self.engine.scripted
        return stream.verdicts


@pytest.fixture
async def harness(tokenizer_dir: Path) -> AsyncIterator[Harness]:
    engine = ScriptedEngine(tokenizer_dir, [])
    metrics = ServerMetrics()
    server = Server([VllmEngineServicer(engine, metrics=metrics)])
    await server.start("127.0.0.1", 0)
    channel = Channel("127.0.0.1", server._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    try:
        yield Harness(engine, VllmClient(channel), metrics)
    finally:
        engine.release.set()  # a parked handler finishes quietly
        channel.close()
        server.close()
        await server.wait_closed()


async def test_the_last_pushed_message_ends_the_call_without_waking_the_handler(harness: Harness) -> None:
    harness.engine.script = [make_output([100], num_tokens=1), make_output([101], num_tokens=2),
                             make_output([102], finish=FinishReason.LENGTH, num_tokens=3)]
    # the handler stays parked in its iterator (release not set) while the client sees the call end OK
    messages, error = await harness.call(stream=True)
    assert error is None
    assert [m.WhichOneof("response") for m in messages] == ["chunk"] * 3 + ["complete"]
    assert [list(m.chunk.token_ids) for m in messages[:3]] == [[100], [101], [102]]
    assert list(messages[-1].complete.output_ids) == [100, 101, 102]
    assert messages[-1].complete.finish_reason == "length"
    assert harness.verdicts == [True, True, True]
    assert not harness.engine.release.is_set()


async def test_what_push_cannot_write_whole_the_handler_sends_once_and_in_order(harness: Harness) -> None:
    first = [BIG_TOKEN_ID + i for i in range(4000)]
    second = [BIG_TOKEN_ID + i for i in range(4000, 6000)]
    harness.engine.script = [make_output(first, num_tokens=4000),
                             make_output(second, finish=FinishReason.LENGTH, num_tokens=6000)]
    harness.engine.release.set()
    messages, error = await harness.call(stream=True)
    assert error is None
    # the second output's chunk is pushed; its `complete` is past one frame: declined, the handler sends it
    assert harness.verdicts == [True, False]
    assert [m.WhichOneof("response") for m in messages] == ["chunk", "chunk", "complete"]
    assert [list(m.chunk.token_ids) for m in messages[:2]] == [first, second]
    assert list(messages[-1].complete.output_ids) == first + second  # built once: nothing twice
    assert messages[-1].ByteSize() > 16384
    assert harness.metrics.registry.get_sample_value("engine_generated_tokens_total") == 6000


@pytest.mark.parametrize("error", ["simulated engine failure", None], ids=["error", "error-finish"])
async def test_an_engine_failure_is_declined_and_ends_the_call_with_internal(
    harness: Harness, error: str | None
) -> None:
    harness.engine.script = [make_output([100], num_tokens=1),
                             make_output([101], finish=FinishReason.ERROR, error=error, num_tokens=2),
                             make_output([102], num_tokens=3)]
    harness.engine.release.set()
    messages, failure = await harness.call(stream=True)
    assert harness.verdicts == [True, False, None]
    assert [list(m.chunk.token_ids) for m in messages] == [[100]]
    assert failure is not None
    assert failure.status is Status.INTERNAL


async def test_non_stream_pushes_the_silent_outputs_and_sends_its_one_response_from_the_handler(
    harness: Harness,
) -> None:
    harness.engine.script = [make_output([100], num_tokens=1), make_output([101], num_tokens=2),
                             make_output([102], finish=FinishReason.LENGTH, num_tokens=3)]
    harness.engine.release.set()
    messages, error = await harness.call(stream=False)
    assert error is None
    # the headers wait for the one response (as before), so push cannot write it: the handler does
    assert harness.verdicts == [True, True, False]
    assert [m.WhichOneof("response") for m in messages] == ["complete"]
    assert list(messages[0].complete.output_ids) == [100, 101, 102]


async def test_a_constrained_stream_sends_its_first_output_from_the_handler(harness: Harness) -> None:
    harness.engine.script = [make_output([100], num_tokens=1), make_output([101], num_tokens=2),
                             make_output([102], finish=FinishReason.DEAD_END, num_tokens=3)]
    harness.engine.release.set()
    messages, error = await harness.call(stream=True, regex="[ab]+")
    assert error is None
    # the headers wait for the first message (its constraint compiles after admission), so push cannot
    # write it; what follows a declined output waits for the handler too (the stream offers nothing then)
    assert harness.verdicts == [False, None, None]
    assert [m.WhichOneof("response") for m in messages] == ["chunk"] * 3 + ["complete"]
    assert [list(m.chunk.token_ids) for m in messages[:3]] == [[100], [101], [102]]
    assert messages[-1].complete.finish_reason == "stop"


class RecordingSender:
    """FastSender's in-place writes: takes the first `capacity` messages."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.sent: list[Any] = []
        self.has_ended = False

    def try_send(self, message: Any) -> bool:
        if len(self.sent) >= self.capacity:
            return False
        self.sent.append(message)
        return True

    def try_send_ok_trailers(self) -> bool:
        self.has_ended = True
        return True


def _writer(sender: RecordingSender) -> OutputWriter:
    builder = ResponseBuilder(stream=True, prompt_token_ids=PROMPT, num_logprobs=None,
                              num_prompt_logprobs=None)
    return OutputWriter(builder, cast(FastSender, sender), None)


def test_push_declines_while_the_handler_sends_and_the_output_is_built_once() -> None:
    sender = RecordingSender(capacity=10)
    writer = _writer(sender)
    last = make_output([100], finish=FinishReason.LENGTH, num_tokens=1)
    writer.is_sending = True
    assert not writer.push(last)  # must not overtake the message the handler is writing
    assert sender.sent == []
    assert not sender.has_ended
    writer.is_sending = False
    messages = writer.take(last)
    assert [m.WhichOneof("response") for m in messages] == ["chunk", "complete"]
    assert list(messages[1].complete.output_ids) == [100]


def test_a_partly_written_output_leaves_the_rest_to_the_handler() -> None:
    sender = RecordingSender(capacity=1)
    writer = _writer(sender)
    last = make_output([100], finish=FinishReason.LENGTH, num_tokens=1)
    assert not writer.push(last)
    assert [m.WhichOneof("response") for m in sender.sent] == ["chunk"]
    assert not sender.has_ended  # the handler ends the call once it has sent the rest
    assert not writer.push(make_output([], num_tokens=1))  # nothing overtakes the held rest
    rest = writer.take(last)
    assert [m.WhichOneof("response") for m in rest] == ["complete"]
    assert list(rest[0].complete.output_ids) == [100]
