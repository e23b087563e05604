"""Structured output over engine.v1 on a real server: every kind works, every bad constraint is
INVALID_ARGUMENT naming its field (streamed or not, before or after the engine compiled it), and nothing else
suffers: the server keeps serving, the engine ends idle with every KV block free."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jsonschema
import pytest
from apiutil import CALL_TIMEOUT_S, completion_text, finish_reasons, greedy_request, wait_engine_idle
from engine_proto.engine.v1 import generate_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from fuzz_calls import ENGINE_PREFIX, VLLM_PREFIX, RawMessage, call, log_kept_clean
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from serverproc import RunningServer
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

SO = generate_pb2.StructuredOutput
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "temp": {"type": "integer", "minimum": -30, "maximum": 45},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["city", "temp"],
    "additionalProperties": False,
}


def constrained(
    so: generate_pb2.StructuredOutput,
    *,
    stream: bool = True,
    max_tokens: int = 96,
    temperature: float = 0.0,
    seed: int | None = None,
    n: int = 1,
) -> generate_pb2.GenerateRequest:
    request = greedy_request(text="Weather report:", max_tokens=max_tokens, stream=stream)
    request.structured_output.CopyFrom(so)
    request.sampling.temperature = temperature
    request.sampling.n = n
    if seed is not None:
        request.sampling.seed = seed
    return request


def texts(responses: list[generate_pb2.GenerateResponse], n: int = 1) -> list[str]:
    return [completion_text(responses, i) for i in range(n)]


@pytest.fixture(scope="module", autouse=True)
def _log_clean(server: RunningServer) -> Iterator[None]:
    yield from log_kept_clean(server)


# 1) every kind of constraint, streamed and not


@pytest.mark.parametrize("stream", [True, False])
async def test_json_schema_output_validates(stub: EngineServiceStub, stream: bool) -> None:
    request = constrained(SO(json_schema=json.dumps(SCHEMA)), stream=stream, temperature=1.5, seed=7, n=3)
    responses = await stub.Generate(request, timeout=CALL_TIMEOUT_S)
    assert finish_reasons(responses) == {i: generate_pb2.FINISH_REASON_STOP for i in range(3)}
    for text in texts(responses, 3):
        jsonschema.validate(json.loads(text), SCHEMA)


async def test_each_kind(stub: EngineServiceStub) -> None:
    tag = generate_pb2.StructuralTagItem(begin="<call=f>", json_schema=json.dumps(SCHEMA), end="</call>")
    cases: list[tuple[generate_pb2.StructuredOutput, Callable[[str], bool]]] = [
        (SO(json_object=generate_pb2.JsonObject()), lambda t: isinstance(json.loads(t), dict)),
        (SO(regex="[0-9]{4}-[0-9]{2}-[0-9]{2}"), lambda t: len(t) == 10 and t[4] == t[7] == "-"),
        (
            SO(grammar='start: NUM ("+" NUM)*\nNUM: /[1-9][0-9]?/\n'),
            lambda t: all(part.isdigit() for part in t.split("+")),
        ),
        (
            SO(choice=generate_pb2.Choice(choices=["red", "green", "blue"])),
            lambda t: t in {"red", "green", "blue"},
        ),
        (SO(structural_tag=generate_pb2.StructuralTag(tags=[tag], triggers=["<call="])), lambda t: True),
    ]
    for so, check in cases:
        responses = await stub.Generate(constrained(so, max_tokens=48), timeout=CALL_TIMEOUT_S)
        (text,) = texts(responses)
        reason = finish_reasons(responses)[0]
        assert reason in (generate_pb2.FINISH_REASON_STOP, generate_pb2.FINISH_REASON_LENGTH), so
        if reason == generate_pb2.FINISH_REASON_STOP:
            assert check(text), (so, text)
    await wait_engine_idle(stub)


# 2) bad constraints: INVALID_ARGUMENT naming the field, with the library's message


@dataclass(frozen=True)
class Bad:
    name: str
    so: generate_pb2.StructuredOutput
    field: str
    says: str  # the message contains this


def _tags(*items: tuple[str, str, str], triggers: tuple[str, ...] = ("<",)) -> generate_pb2.StructuredOutput:
    return SO(
        structural_tag=generate_pb2.StructuralTag(
            tags=[generate_pb2.StructuralTagItem(begin=b, json_schema=s, end=e) for b, s, e in items],
            triggers=list(triggers),
        )
    )


BAD = [
    Bad(
        "schema not JSON",
        SO(json_schema="{'type': 'object'"),
        "structured_output.json_schema",
        "not valid JSON",
    ),
    Bad("schema not an object", SO(json_schema="[1, 2]"), "structured_output.json_schema", "JSON object"),
    Bad(
        "schema type unknown", SO(json_schema='{"type": "objekt"}'), "structured_output.json_schema", "objekt"
    ),
    Bad(
        "unsupported keyword",
        SO(json_schema='{"type": "array", "uniqueItems": true}'),
        "structured_output.json_schema",
        "uniqueItems",
    ),
    Bad(
        "unknown format",
        SO(json_schema='{"type": "string", "format": "zipcode"}'),
        "structured_output.json_schema",
        "zipcode",
    ),
    Bad("invalid regex", SO(regex="([0-9]+"), "structured_output.regex", "unclosed group"),
    Bad("grammar syntax error", SO(grammar="start: expr\nexpr: ("), "structured_output.grammar", ""),
    Bad(
        "grammar unknown rule", SO(grammar="start: missing_rule"), "structured_output.grammar", "missing_rule"
    ),
    Bad("empty choice list", SO(choice=generate_pb2.Choice()), "structured_output.choice", "at least one"),
    Bad(
        "empty choice",
        SO(choice=generate_pb2.Choice(choices=["a", ""])),
        "structured_output.choice",
        "non-empty",
    ),
    Bad("empty regex", SO(regex=""), "structured_output.regex", "empty"),
    Bad("no kind", SO(), "structured_output", "must be set"),
    Bad(
        "over the size bound",
        SO(json_schema=json.dumps({"enum": ["x" * 70_000]})),
        "structured_output.json_schema",
        "65536",
    ),
    Bad(
        "choices over the size bound",
        SO(choice=generate_pb2.Choice(choices=["y" * 1000] * 70)),
        "structured_output.choice",
        "65536",
    ),
    Bad(
        "tag without trigger",
        _tags(("<f>", "", "</f>"), triggers=()),
        "structured_output.structural_tag.triggers",
        "trigger",
    ),
    Bad(
        "tag begin off its triggers",
        _tags(("[f]", "", "[/f]")),
        "structured_output.structural_tag.tags[0].begin",
        "trigger",
    ),
    Bad(
        "tag schema not JSON",
        _tags(("<f>", "{", "</f>")),
        "structured_output.structural_tag.tags[0].json_schema",
        "not valid JSON",
    ),
]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("bad", BAD, ids=[b.name for b in BAD])
async def test_bad_constraint(stub: EngineServiceStub, bad: Bad, stream: bool) -> None:
    with pytest.raises(GRPCError) as caught:
        await stub.Generate(constrained(bad.so, stream=stream), timeout=CALL_TIMEOUT_S)
    message = caught.value.message or ""
    assert caught.value.status == Status.INVALID_ARGUMENT, message
    assert message.startswith(f"{bad.field}:"), message
    assert bad.says in message, message


async def test_bad_constraint_sent_again_is_refused_again(stub: EngineServiceStub) -> None:
    """The compile error is cached: the second request gets the same answer (at once)."""
    so = SO(regex="(x|y")
    messages = []
    for _ in range(2):
        with pytest.raises(GRPCError) as caught:
            await stub.Generate(constrained(so), timeout=CALL_TIMEOUT_S)
        assert caught.value.status == Status.INVALID_ARGUMENT
        messages.append(caught.value.message)
    assert messages[0] == messages[1]


async def test_two_constraints_at_once(port: int) -> None:
    """Two members of the oneof on the wire: protobuf would keep the last; the server refuses the request."""
    both = (
        constrained(SO(json_schema=json.dumps(SCHEMA))).SerializeToString()
        + generate_pb2.GenerateRequest(structured_output=SO(regex="a+")).SerializeToString()
    )
    for stream in (True, False):
        raw = both + generate_pb2.GenerateRequest(stream=stream).SerializeToString()
        outcome = await call(
            port, ENGINE_PREFIX + "Generate", RawMessage(raw), generate_pb2.GenerateResponse, streaming=True
        )
        assert outcome.status == Status.INVALID_ARGUMENT, outcome
        assert (outcome.message or "").startswith(
            "structured_output.kind: sets both json_schema and regex"
        ), outcome


@pytest.mark.parametrize("stream", [True, False])
async def test_two_constraints_at_once_vllm(port: int, stream: bool) -> None:
    """The same on the vLLM-compatible service: its `constraint` oneof."""
    base = vllm_pb.GenerateRequest(
        request_id="two", tokenized=vllm_pb.TokenizedInput(input_ids=[5, 6, 7]), stream=stream
    )
    base.sampling_params.max_tokens = 8
    base.sampling_params.regex = "a+"
    extra = vllm_pb.GenerateRequest()
    extra.sampling_params.choice.choices.append("yes")
    raw = base.SerializeToString() + extra.SerializeToString()
    outcome = await call(
        port, VLLM_PREFIX + "Generate", RawMessage(raw), vllm_pb.GenerateResponse, streaming=True
    )
    assert outcome.status == Status.INVALID_ARGUMENT, outcome
    assert (outcome.message or "").startswith("sampling_params.constraint: sets both regex and choice"), (
        outcome
    )


async def test_server_serves_and_engine_idle_after_bad_constraints(stub: EngineServiceStub) -> None:
    responses = await stub.Generate(greedy_request(text="fine", max_tokens=3), timeout=CALL_TIMEOUT_S)
    assert completion_text(responses) is not None
    load = await wait_engine_idle(stub)
    assert load.num_free_kv_blocks == load.num_total_kv_blocks
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0)
