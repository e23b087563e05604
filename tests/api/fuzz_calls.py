"""What the API fuzz tests share: one call with its outcome, the checks every outcome and
every successful Generate stream must pass, and the wait for the engine to settle."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from apiutil import wait_engine_idle
from engine_proto.engine.v1 import generate_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from google.protobuf.message import Message
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from h2.exceptions import StreamClosedError
from hypothesis import event
from serverproc import RunningServer

# What a client may be told about its own request; anything else is the server's fault.
CLIENT_ERRORS = frozenset({
    Status.INVALID_ARGUMENT, Status.OUT_OF_RANGE, Status.RESOURCE_EXHAUSTED, Status.FAILED_PRECONDITION,
    Status.NOT_FOUND, Status.ALREADY_EXISTS, Status.UNIMPLEMENTED,
})
MAX_MESSAGES = 24  # a stream still going after this many messages is cancelled (which must not leak either)
CALL_S = 20.0

ENGINE_PREFIX = "/engine.v1.EngineService/"
VLLM_PREFIX = "/vllm.grpc.engine.VllmEngine/"

VOCAB_SIZE = 1024  # the tiny demo model's (engine_server/models/tiny.py)
EOS_ID = 1
MAX_MODEL_LEN = 2048


@dataclass
class Outcome:
    status: Status
    message: str | None
    replies: list[Any]
    cancelled: bool = False


class RawMessage:
    """A request whose bytes are given as they are (grpclib's codec calls SerializeToString)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


async def call(port: int, path: str, request: Any, reply_type: type[Message], *, streaming: bool,
               cancel_after: int = MAX_MESSAGES) -> Outcome:
    channel = Channel("127.0.0.1", port)
    cardinality = Cardinality.UNARY_STREAM if streaming else Cardinality.UNARY_UNARY
    replies: list[Any] = []
    try:
        async with channel.request(path, cardinality, type(request), reply_type, timeout=CALL_S) as stream:
            await stream.send_message(request, end=True)
            while (reply := await stream.recv_message()) is not None:
                replies.append(reply)
                if len(replies) >= cancel_after:
                    with contextlib.suppress(StreamClosedError):  # the server may have ended it meanwhile
                        await stream.cancel()
                    return Outcome(Status.OK, None, replies, cancelled=True)
            await stream.recv_trailing_metadata()
        return Outcome(Status.OK, None, replies)
    except GRPCError as error:
        return Outcome(error.status, error.message, replies)
    finally:
        channel.close()


async def settled(port: int, outcomes: list[Outcome]) -> None:
    """The engine is idle again with every KV block free (within wait_engine_idle's bound)."""
    channel = Channel("127.0.0.1", port)
    try:
        load = await wait_engine_idle(EngineServiceStub(channel))
    finally:
        channel.close()
    assert load.num_running_requests == 0, (outcomes, load)
    assert load.num_waiting_requests == 0, (outcomes, load)
    assert load.num_free_kv_blocks == load.num_total_kv_blocks, (outcomes, load)


async def call_and_settle(port: int, path: str, request: Any, reply_type: type[Message], *,
                          streaming: bool, cancel_after: int = MAX_MESSAGES) -> Outcome:
    outcome = await call(port, path, request, reply_type, streaming=streaming, cancel_after=cancel_after)
    await settled(port, [outcome])
    return outcome


def check(outcome: Outcome, request: Any) -> None:
    # counted by pytest --hypothesis-show-statistics
    event(f"{outcome.status.name}{' (cancelled)' if outcome.cancelled else ''}")
    if outcome.status == Status.OK:
        return
    assert outcome.status in CLIENT_ERRORS, f"{outcome.status.name}: {outcome.message!r} for\n{request}"
    assert outcome.message, f"{outcome.status.name} without a message for\n{request}"


def run(coroutine: Any) -> Outcome:
    result: Outcome = asyncio.run(coroutine)
    return result


def assert_log_clean(log: str) -> None:
    for marker in ("Traceback", "Exception in callback", "Task exception was never retrieved", "ERROR"):
        assert marker not in log, log[-4000:]


def log_kept_clean(server: RunningServer) -> Iterator[None]:
    """For a module fixture: the server logs nothing it did not expect while the module's tests run."""
    start = len(server.log())
    yield
    time.sleep(0.2)  # what the last call's teardown logs
    assert_log_clean(server.log()[start:])


def engine_base() -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(stream=True)
    request.token_ids.ids.extend([5, 17, 300, 42, 9])
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = 4
    return request


def check_generated(request: generate_pb2.GenerateRequest, outcome: Outcome) -> None:
    """What engine.v1 promises about a Generate stream that ended OK (generate.proto's comments)."""
    if outcome.status != Status.OK or outcome.cancelled:
        return
    replies: list[generate_pb2.GenerateResponse] = outcome.replies
    n = request.sampling.n if request.sampling.HasField("n") else 1
    assert replies
    assert len(replies) == 1 or request.stream
    tokens: dict[int, int] = dict.fromkeys(range(n), 0)
    finished: dict[int, generate_pb2.CompletionChunk] = {}
    for i, reply in enumerate(replies):
        assert reply.request_id == (request.request_id or replies[0].request_id)
        assert reply.HasField("usage") == (i == len(replies) - 1)
        assert not reply.prompt_logprobs or i == 0
        for chunk in reply.completions:
            assert chunk.index in tokens
            assert chunk.index not in finished, "output after the completion's finish"
            tokens[chunk.index] += len(chunk.token_ids)
            assert all(t < VOCAB_SIZE for t in chunk.token_ids)
            if request.output.HasField("logprobs"):
                assert [lp.token_id for lp in chunk.logprobs] == list(chunk.token_ids)
                assert all(len(lp.top) == request.output.logprobs for lp in chunk.logprobs)
                assert not any(math.isnan(lp.logprob) for lp in chunk.logprobs)
            else:
                assert not chunk.logprobs
            if request.output.HasField("return_text") and not request.output.return_text:
                assert not chunk.text
            if chunk.finish_reason:
                finished[chunk.index] = chunk
    assert sorted(finished) == list(range(n)), "every completion finishes exactly once"
    usage = replies[-1].usage
    assert usage.completion_tokens == sum(tokens.values())
    if request.WhichOneof("input") == "token_ids":
        assert usage.prompt_tokens == len(request.token_ids.ids)
    if request.output.HasField("prompt_logprobs"):
        assert len(replies[0].prompt_logprobs) == usage.prompt_tokens - 1
    for index, chunk in finished.items():
        if request.stopping.HasField("max_tokens"):
            assert tokens[index] <= request.stopping.max_tokens
            at_limit = (tokens[index] == request.stopping.max_tokens
                        or usage.prompt_tokens + tokens[index] >= MAX_MODEL_LEN)
            assert chunk.finish_reason != generate_pb2.FINISH_REASON_LENGTH or at_limit
        if chunk.WhichOneof("matched_stop") == "stop_string":
            assert chunk.stop_string in request.stopping.stop
        elif chunk.WhichOneof("matched_stop") == "stop_token_id":
            assert chunk.stop_token_id in {*request.stopping.stop_token_ids, EOS_ID}


