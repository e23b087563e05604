"""Fuzzed requests against a real engine-server (tiny model, engine core in its own process).

Every call must end with OK or a status that tells the client what it did wrong, with a message; never
UNKNOWN / INTERNAL (an exception the server did not expect), never a hang. After each one the engine must be
idle with every KV block free, and at the end the server's log must hold no traceback. Requests are valid
base requests with random fields overwritten (tests/fuzz_proto.py), for both services on the port:
engine.v1.EngineService and vllm.grpc.engine.VllmEngine (what the smg gateway sends); and valid requests'
bytes, mutated, for the parser.

Hypothesis runs a fixed set of examples in CI (derandomized); ENGINE_FUZZ_EXAMPLES=N runs N per test
(random, for a bug hunt).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from apiutil import wait_engine_idle
from engine_proto.engine.v1 import embed_pb2, generate_pb2, tokenize_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from fuzz_proto import MessageFuzzer
from google.protobuf.message import Message
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serverproc import RunningServer
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

_EXAMPLES = int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "0"))


def fuzz_settings(ci_examples: int) -> Callable[[Any], Any]:
    return settings(
        max_examples=_EXAMPLES or ci_examples,
        derandomize=not _EXAMPLES,
        database=None,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
        ],
    )


# What a client may be told about its own request; anything else is the server's fault.
CLIENT_ERRORS = frozenset({
    Status.INVALID_ARGUMENT, Status.OUT_OF_RANGE, Status.RESOURCE_EXHAUSTED, Status.FAILED_PRECONDITION,
    Status.NOT_FOUND, Status.ALREADY_EXISTS, Status.UNIMPLEMENTED,
})
MAX_MESSAGES = 24  # a stream still going after this many messages is cancelled (which must not leak either)
CALL_S = 20.0

ENGINE_PREFIX = "/engine.v1.EngineService/"
VLLM_PREFIX = "/vllm.grpc.engine.VllmEngine/"

fuzzer = MessageFuzzer(small=1100)


@dataclass
class Outcome:
    status: Status
    message: str | None
    num_messages: int
    cancelled: bool = False


class RawMessage:
    """A request whose bytes are given as they are (grpclib's codec calls SerializeToString)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


async def call(port: int, path: str, request: Any, reply_type: type[Message], *, streaming: bool) -> Outcome:
    channel = Channel("127.0.0.1", port)
    cardinality = Cardinality.UNARY_STREAM if streaming else Cardinality.UNARY_UNARY
    received = 0
    try:
        async with channel.request(path, cardinality, type(request), reply_type, timeout=CALL_S) as stream:
            await stream.send_message(request, end=True)
            while await stream.recv_message() is not None:
                received += 1
                if received >= MAX_MESSAGES:
                    await stream.cancel()
                    return Outcome(Status.OK, None, received, cancelled=True)
            await stream.recv_trailing_metadata()
        return Outcome(Status.OK, None, received)
    except GRPCError as error:
        return Outcome(error.status, error.message, received)
    finally:
        channel.close()


async def call_and_settle(port: int, path: str, request: Any, reply_type: type[Message], *,
                          streaming: bool) -> Outcome:
    outcome = await call(port, path, request, reply_type, streaming=streaming)
    channel = Channel("127.0.0.1", port)
    try:
        load = await wait_engine_idle(EngineServiceStub(channel))
    finally:
        channel.close()
    assert load.num_running_requests == 0, (outcome, load)
    assert load.num_waiting_requests == 0, (outcome, load)
    assert load.num_free_kv_blocks == load.num_total_kv_blocks, (outcome, load)
    return outcome


def check(outcome: Outcome, request: Any, allowed: frozenset[Status] = CLIENT_ERRORS) -> None:
    # counted by pytest --hypothesis-show-statistics
    event(f"{outcome.status.name}{' (cancelled)' if outcome.cancelled else ''}")
    if outcome.status == Status.OK:
        return
    assert outcome.status in allowed, f"{outcome.status.name}: {outcome.message!r} for\n{request}"
    assert outcome.message, f"{outcome.status.name} without a message for\n{request}"


def run(coroutine: Any) -> Outcome:
    result: Outcome = asyncio.run(coroutine)
    return result


@pytest.fixture(scope="module")
def port(server: RunningServer) -> int:
    return server.port


@pytest.fixture(scope="module", autouse=True)
def log_stays_clean(server: RunningServer) -> Any:
    """The server logs nothing it did not expect while the fuzzed requests run."""
    start = len(server.log())
    yield
    time.sleep(0.2)
    log = server.log()[start:]
    for marker in ("Traceback", "Exception in callback", "Task exception was never retrieved", "ERROR"):
        assert marker not in log, log[-4000:]


def engine_base() -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(stream=True)
    request.token_ids.ids.extend([5, 17, 300, 42, 9])
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = 4
    return request


def vllm_base() -> vllm_pb.GenerateRequest:
    request = vllm_pb.GenerateRequest(request_id="fuzz", stream=True)
    request.tokenized.input_ids.extend([5, 17, 300, 42, 9])
    request.tokenized.original_text = "fuzz"
    request.sampling_params.temperature = 0.0
    request.sampling_params.max_tokens = 4
    return request


@fuzz_settings(ci_examples=300)
@given(fuzzer.overlay(engine_base))
def test_engine_generate(port: int, request: generate_pb2.GenerateRequest) -> None:
    outcome = run(call_and_settle(port, ENGINE_PREFIX + "Generate", request, generate_pb2.GenerateResponse,
                                  streaming=True))
    check(outcome, request)


@fuzz_settings(ci_examples=80)
@given(fuzzer.overlay(vllm_base))
def test_vllm_generate(port: int, request: vllm_pb.GenerateRequest) -> None:
    outcome = run(call_and_settle(port, VLLM_PREFIX + "Generate", request, vllm_pb.GenerateResponse,
                                  streaming=True))
    check(outcome, request)


UNARY = [
    ("Tokenize", tokenize_pb2.TokenizeRequest, tokenize_pb2.TokenizeResponse),
    ("Detokenize", tokenize_pb2.DetokenizeRequest, tokenize_pb2.DetokenizeResponse),
    ("Embed", embed_pb2.EmbedRequest, embed_pb2.EmbedResponse),
    ("Abort", generate_pb2.AbortRequest, generate_pb2.AbortResponse),
]


@fuzz_settings(ci_examples=80)
@given(st.sampled_from(UNARY).flatmap(
    lambda rpc: st.tuples(st.just(rpc[0]), fuzzer.messages(rpc[1]), st.just(rpc[2]))))
def test_engine_unary(port: int, rpc: tuple[str, Message, type[Message]]) -> None:
    method, request, reply_type = rpc
    outcome = run(call_and_settle(port, ENGINE_PREFIX + method, request, reply_type, streaming=False))
    check(outcome, request)


VLLM_UNARY = [
    ("Embed", vllm_pb.EmbedRequest, vllm_pb.EmbedResponse),
    ("Abort", vllm_pb.AbortRequest, vllm_pb.AbortResponse),
    ("GetModelInfo", vllm_pb.GetModelInfoRequest, vllm_pb.GetModelInfoResponse),
    ("GetServerInfo", vllm_pb.GetServerInfoRequest, vllm_pb.GetServerInfoResponse),
    ("GetLoads", vllm_pb.GetLoadsRequest, vllm_pb.GetLoadsResponse),
    ("HealthCheck", vllm_pb.HealthCheckRequest, vllm_pb.HealthCheckResponse),
]


@fuzz_settings(ci_examples=60)
@given(st.sampled_from(VLLM_UNARY).flatmap(
    lambda rpc: st.tuples(st.just(rpc[0]), fuzzer.messages(rpc[1]), st.just(rpc[2]))))
def test_vllm_unary(port: int, rpc: tuple[str, Message, type[Message]]) -> None:
    method, request, reply_type = rpc
    outcome = run(call_and_settle(port, VLLM_PREFIX + method, request, reply_type, streaming=False))
    check(outcome, request)


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """`valid` with a few bytes flipped, inserted or deleted, or cut short."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if action == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif action == "delete":
            del data[at:at + draw(st.integers(1, 4))]
        else:
            del data[at:]
    return bytes(data)


@fuzz_settings(ci_examples=80)
@given(st.sampled_from([
    (ENGINE_PREFIX, engine_base().SerializeToString(), generate_pb2.GenerateResponse),
    (VLLM_PREFIX, vllm_base().SerializeToString(), vllm_pb.GenerateResponse),
]).flatmap(lambda case: st.tuples(st.just(case[0]), mutated(case[1]), st.just(case[2]))))
def test_mutated_bytes(port: int, case: tuple[str, bytes, type[Message]]) -> None:
    prefix, data, reply_type = case
    outcome = run(call_and_settle(port, prefix + "Generate", RawMessage(data), reply_type, streaming=True))
    check(outcome, data)
