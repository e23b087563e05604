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
from collections.abc import Iterator

import pytest
from engine_proto.engine.v1 import embed_pb2, generate_pb2, tokenize_pb2
from fuzz_calls import (
    ENGINE_PREFIX,
    MAX_MESSAGES,
    VLLM_PREFIX,
    VOCAB_SIZE,
    Outcome,
    RawMessage,
    assert_log_clean,
    call,
    call_and_settle,
    check,
    check_generated,
    engine_base,
    run,
    settled,
)
from fuzz_proto import MessageFuzzer
from fuzz_settings import fuzz_settings
from google.protobuf.message import Message
from hypothesis import given
from hypothesis import strategies as st
from serverproc import start_server
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

fuzzer = MessageFuzzer(small=1100)


pytestmark = pytest.mark.usefixtures("server_log_clean")


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
    check_generated(request, outcome)


@fuzz_settings(ci_examples=80)
@given(fuzzer.overlay(vllm_base))
def test_vllm_generate(port: int, request: vllm_pb.GenerateRequest) -> None:
    outcome = run(call_and_settle(port, VLLM_PREFIX + "Generate", request, vllm_pb.GenerateResponse,
                                  streaming=True))
    check(outcome, request)


UNARY = [  # (service prefix, method, request type, reply type)
    (ENGINE_PREFIX, "Tokenize", tokenize_pb2.TokenizeRequest, tokenize_pb2.TokenizeResponse),
    (ENGINE_PREFIX, "Detokenize", tokenize_pb2.DetokenizeRequest, tokenize_pb2.DetokenizeResponse),
    (ENGINE_PREFIX, "Embed", embed_pb2.EmbedRequest, embed_pb2.EmbedResponse),
    (ENGINE_PREFIX, "Abort", generate_pb2.AbortRequest, generate_pb2.AbortResponse),
    (VLLM_PREFIX, "Embed", vllm_pb.EmbedRequest, vllm_pb.EmbedResponse),
    (VLLM_PREFIX, "Abort", vllm_pb.AbortRequest, vllm_pb.AbortResponse),
    (VLLM_PREFIX, "GetModelInfo", vllm_pb.GetModelInfoRequest, vllm_pb.GetModelInfoResponse),
    (VLLM_PREFIX, "GetServerInfo", vllm_pb.GetServerInfoRequest, vllm_pb.GetServerInfoResponse),
    (VLLM_PREFIX, "GetLoads", vllm_pb.GetLoadsRequest, vllm_pb.GetLoadsResponse),
    (VLLM_PREFIX, "HealthCheck", vllm_pb.HealthCheckRequest, vllm_pb.HealthCheckResponse),
]


@fuzz_settings(ci_examples=140)
@given(st.sampled_from(UNARY).flatmap(
    lambda rpc: st.tuples(st.just(rpc[0] + rpc[1]), fuzzer.messages(rpc[2]), st.just(rpc[3]))))
def test_unary(port: int, rpc: tuple[str, Message, type[Message]]) -> None:
    path, request, reply_type = rpc
    outcome = run(call_and_settle(port, path, request, reply_type, streaming=False))
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


# Concurrent requests on a server with a small KV cache: admission, the waiting queue, preemption and
# cancellation all meet.
SMALL_SERVER_ARGS = ("--num-kv-blocks", "24", "--max-num-seqs", "4", "--max-waiting", "6")
Plan = list[tuple[generate_pb2.GenerateRequest, int, float]]  # (request, cancel after, delay) each


@pytest.fixture(scope="module")
def small_port() -> Iterator[int]:
    with start_server(*SMALL_SERVER_ARGS) as running:
        start = len(running.log())
        yield running.port
        assert_log_clean(running.log()[start:])


@st.composite
def concurrent_requests(draw: st.DrawFn) -> Plan:
    """2-10 requests with prompts of 1-150 ids, each with when to cancel it and how long to wait before it."""
    def base() -> generate_pb2.GenerateRequest:
        request = engine_base()
        del request.token_ids.ids[:]
        request.token_ids.ids.extend(draw(st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=150)))
        request.stopping.max_tokens = draw(st.integers(1, 48))
        return request
    plan = []
    for _ in range(draw(st.integers(2, 10))):
        request = draw(fuzzer.overlay(base))
        cancel_after = draw(st.sampled_from([MAX_MESSAGES, MAX_MESSAGES, 1, 2, 4]))
        plan.append((request, cancel_after, draw(st.sampled_from([0.0, 0.0, 0.005, 0.03]))))
    return plan


async def run_concurrently(port: int, plan: Plan) -> list[Outcome]:
    async def one(request: generate_pb2.GenerateRequest, cancel_after: int, delay_s: float) -> Outcome:
        await asyncio.sleep(delay_s)
        return await call(port, ENGINE_PREFIX + "Generate", request, generate_pb2.GenerateResponse,
                          streaming=True, cancel_after=cancel_after)
    outcomes = list(await asyncio.gather(*(one(*item) for item in plan)))
    await settled(port, outcomes)
    return outcomes


@fuzz_settings(ci_examples=40)
@given(concurrent_requests())
def test_engine_generate_concurrently(small_port: int, plan: Plan) -> None:
    outcomes = asyncio.run(run_concurrently(small_port, plan))
    for (request, _, _), outcome in zip(plan, outcomes, strict=True):
        check(outcome, request)
        check_generated(request, outcome)
