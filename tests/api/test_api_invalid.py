"""A table of invalid requests: each gets its status code and a message naming the field; the server still
serves afterwards."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from apiutil import CALL_TIMEOUT_S, completion_ids, greedy_request
from engine_proto.engine.v1 import embed_pb2, generate_pb2, info_pb2, tokenize_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.const import Status
from grpclib.exceptions import GRPCError

VOCAB = 1024  # the tiny model's vocabulary size (checked below against GetModelInfo)
MAX_LEN = 2048


@dataclass(frozen=True)
class Case:
    name: str
    rpc: str
    build: Callable[[], Any]
    field: str  # the message starts with this
    status: Status = Status.INVALID_ARGUMENT


def gen(**changes: Any) -> Callable[[], generate_pb2.GenerateRequest]:
    """A valid greedy request with `section__field=value` changes (a callable value edits the message)."""

    def build() -> generate_pb2.GenerateRequest:
        request = greedy_request(text="hello", max_tokens=4)
        for key, value in changes.items():
            if callable(value):
                value(request)
                continue
            section, _, name = key.partition("__")
            setattr(getattr(request, section), name, value)
        return request

    return build


def _no_input(r: generate_pb2.GenerateRequest) -> None:
    r.ClearField("input")


def _empty_ids(r: generate_pb2.GenerateRequest) -> None:
    r.token_ids.SetInParent()


def _ids(*ids: int) -> Callable[[generate_pb2.GenerateRequest], None]:
    def edit(r: generate_pb2.GenerateRequest) -> None:
        r.token_ids.ids.extend(ids)

    return edit


def _chat(*messages: tuple[str, str]) -> Callable[[generate_pb2.GenerateRequest], None]:
    def edit(r: generate_pb2.GenerateRequest) -> None:
        r.chat.SetInParent()
        for role, content in messages:
            r.chat.messages.add(role=role, content=content)

    return edit


def _stops(*stops: str) -> Callable[[generate_pb2.GenerateRequest], None]:
    def edit(r: generate_pb2.GenerateRequest) -> None:
        r.stopping.stop.extend(stops)

    return edit


def _bias(token_id: int, bias: float) -> Callable[[generate_pb2.GenerateRequest], None]:
    def edit(r: generate_pb2.GenerateRequest) -> None:
        r.sampling.logit_bias[token_id] = bias

    return edit


def _request_id(value: str) -> Callable[[generate_pb2.GenerateRequest], None]:
    def edit(r: generate_pb2.GenerateRequest) -> None:
        r.request_id = value

    return edit


def _detok(*ids: int) -> Callable[[], tokenize_pb2.DetokenizeRequest]:
    return lambda: tokenize_pb2.DetokenizeRequest(token_ids=list(ids))


def _embed() -> embed_pb2.EmbedRequest:
    request = embed_pb2.EmbedRequest()
    request.inputs.add(text="x")
    return request


CASES = [
    Case("no input", "Generate", gen(x=_no_input), "input"),
    Case("empty token ids", "Generate", gen(x=_empty_ids), "token_ids.ids"),
    Case("token id outside vocab", "Generate", gen(x=_ids(5, VOCAB)), "token_ids.ids[1]"),
    Case("chat without messages", "Generate", gen(x=_chat()), "chat.messages"),
    Case("chat message without role", "Generate", gen(x=_chat(("", "hi"))), "chat.messages[0].role"),
    Case("temperature < 0", "Generate", gen(sampling__temperature=-0.5), "sampling.temperature"),
    Case("temperature NaN", "Generate", gen(sampling__temperature=math.nan), "sampling.temperature"),
    Case("temperature inf", "Generate", gen(sampling__temperature=math.inf), "sampling.temperature"),
    Case("top_p 0", "Generate", gen(sampling__top_p=0.0), "sampling.top_p"),
    Case("top_p > 1", "Generate", gen(sampling__top_p=1.5), "sampling.top_p"),
    Case("min_p > 1", "Generate", gen(sampling__min_p=2.0), "sampling.min_p"),
    Case(
        "repetition_penalty 0",
        "Generate",
        gen(sampling__repetition_penalty=0.0),
        "sampling.repetition_penalty",
    ),
    Case("presence_penalty 3", "Generate", gen(sampling__presence_penalty=3.0), "sampling.presence_penalty"),
    Case(
        "frequency_penalty -3",
        "Generate",
        gen(sampling__frequency_penalty=-3.0),
        "sampling.frequency_penalty",
    ),
    Case("n 0", "Generate", gen(sampling__n=0), "sampling.n"),
    Case("n 17", "Generate", gen(sampling__n=17), "sampling.n"),
    Case("logit_bias 200", "Generate", gen(x=_bias(5, 200.0)), "sampling.logit_bias[5]"),
    Case(
        "logit_bias token outside vocab",
        "Generate",
        gen(x=_bias(VOCAB + 3, 1.0)),
        f"sampling.logit_bias[{VOCAB + 3}]",
    ),
    Case("max_tokens 0", "Generate", gen(stopping__max_tokens=0), "stopping.max_tokens"),
    Case("max_tokens past the context", "Generate", gen(stopping__max_tokens=MAX_LEN), "stopping.max_tokens"),
    Case("min_tokens > max_tokens", "Generate", gen(stopping__min_tokens=10), "stopping.min_tokens"),
    Case("empty stop string", "Generate", gen(x=_stops("")), "stopping.stop[0]"),
    Case("17 stop strings", "Generate", gen(x=_stops(*[f"s{i}" for i in range(17)])), "stopping.stop"),
    Case(
        "stop token outside vocab",
        "Generate",
        gen(x=lambda r: r.stopping.stop_token_ids.append(VOCAB)),
        "stopping.stop_token_ids[0]",
    ),
    Case("logprobs 21", "Generate", gen(output__logprobs=21), "output.logprobs"),
    Case("prompt_logprobs 21", "Generate", gen(output__prompt_logprobs=21), "output.prompt_logprobs"),
    Case("request_id too long", "Generate", gen(x=_request_id("r" * 129)), "request_id"),
    Case("prompt past the context", "Generate", gen(x=lambda r: setattr(r, "text", "a " * MAX_LEN)), "text"),
    Case("tokenize without input", "Tokenize", tokenize_pb2.TokenizeRequest, "input"),
    Case("detokenize outside vocab", "Detokenize", _detok(1, 2, VOCAB), "token_ids[2]"),
    Case("embed on a generation model", "Embed", _embed, "model"),
    Case(
        "abort of 1025 ids",
        "Abort",
        lambda: generate_pb2.AbortRequest(request_ids=["x"] * 1025),
        "request_ids",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_invalid_request(stub: EngineServiceStub, case: Case) -> None:
    with pytest.raises(GRPCError) as caught:
        await getattr(stub, case.rpc)(case.build(), timeout=CALL_TIMEOUT_S)
    assert caught.value.status == case.status, caught.value.message
    message = caught.value.message or ""
    assert message.startswith(f"{case.field}:"), message


async def test_server_serves_after_the_invalid_requests(stub: EngineServiceStub) -> None:
    info = await stub.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert (info.vocab_size, info.max_context_length) == (VOCAB, MAX_LEN)
    responses = await stub.Generate(greedy_request(text="fine", max_tokens=3), timeout=CALL_TIMEOUT_S)
    assert completion_ids(responses)
