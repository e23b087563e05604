"""Structured outputs on the vllm.grpc.engine.VllmEngine servicer (fake engine, loopback): SamplingParams'
`constraint` oneof reaches the engine as our StructuredOutput, malformed ones are INVALID_ARGUMENT naming the
field, a constraint refused after admission ends the call before its headers, a dead end finishes as "stop".
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest
from engine_server.engine.structured.grammars import grammar_of
from engine_server.engine.types import (
    MAX_STRUCTURED_OUTPUT_BYTES,
    FinishReason,
    RequestError,
    StructuredOutput,
)
from engine_server.engine.types import StructuredOutputKind as Kind
from fake_engine import FakeEngine, expected_tokens
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from llguidance.gbnf_to_lark import gbnf_to_lark
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from test_vllm_servicer import make_request
from vllm_client import VllmClient, read_all

SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
GBNF = 'root ::= answer digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]\n'
LARK = 'start: ("yes" | "no") /[0-9]/\n'
# smg with a tool parser that has structural tags (here --tool-call-parser mistral, tool_choice "required")
STRUCTURAL_TAG = json.dumps({"format": {
    "type": "triggered_tags", "triggers": ["[TOOL_CALLS]"], "at_least_one": True, "tags": [{
        "begin": "[TOOL_CALLS] [", "end": "]",
        "content": {"type": "json_schema", "json_schema": {"type": "object"}},
    }],
}})


@pytest.mark.parametrize(("params", "expected"), [
    ({"json_schema": SCHEMA}, StructuredOutput(Kind.JSON_SCHEMA, spec=SCHEMA, field_name="json_schema")),
    ({"regex": "(yes|no)[0-9]"}, StructuredOutput(Kind.REGEX, spec="(yes|no)[0-9]", field_name="regex")),
    ({"grammar": LARK}, StructuredOutput(Kind.GRAMMAR, spec=LARK, field_name="grammar")),
    ({"structural_tag": STRUCTURAL_TAG},
     StructuredOutput(Kind.STRUCTURAL_TAG_JSON, spec=STRUCTURAL_TAG, field_name="structural_tag")),
    ({"json_object": True}, StructuredOutput(Kind.JSON_OBJECT, field_name="json_object")),
    ({"choice": pb.ChoiceConstraint(choices=["yes", "no"])},
     StructuredOutput(Kind.CHOICE, choices=("yes", "no"), field_name="choice")),
    ({"json_object": False}, None),  # a bool member of the oneof: false is set on the wire, asks nothing
    ({}, None),
], ids=["json_schema", "regex", "lark", "structural_tag", "json_object", "choice", "json_object_false",
        "none"])
async def test_each_constraint_reaches_the_engine(
    client: VllmClient, engine: FakeEngine, params: dict[str, Any], expected: StructuredOutput | None
) -> None:
    messages = await client.generate_all(make_request(stream=True, max_tokens=2, **params))
    assert [t for m in messages[:-1] for t in m.chunk.token_ids] == expected_tokens(0, 2)
    assert messages[-1].complete.finish_reason == "length"
    (received,) = engine.received
    assert received.structured_output == expected


async def test_gbnf_grammar_reaches_the_engine_as_sent(client: VllmClient, engine: FakeEngine) -> None:
    """The engine converts GBNF where it compiles (a Python conversion: never on the frontend's loop)."""
    await client.generate_all(make_request(stream=False, max_tokens=1, grammar=GBNF))
    constraint = engine.received[0].structured_output
    assert constraint is not None
    assert (constraint.kind, constraint.field_name, constraint.spec) == (Kind.GRAMMAR, "grammar", GBNF)
    # what the engine compiles is the Lark llguidance's converter makes of it, and llguidance takes it
    grammar = grammar_of(constraint)
    assert grammar == llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(GBNF))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


@pytest.mark.parametrize("text", [
    'root ::= ("yes"',  # GBNF that does not parse
    "root ::= " + "(" * 5000 + '"a"' + ")" * 5000,  # deeper than Python recurses
], ids=["bad_gbnf", "deep_gbnf"])
def test_gbnf_that_does_not_convert_is_refused_naming_grammar(text: str) -> None:
    with pytest.raises(RequestError) as info:
        grammar_of(StructuredOutput(Kind.GRAMMAR, spec=text, field_name="grammar"))
    assert info.value.field_name == "grammar"
    assert "GBNF" in str(info.value)


async def test_grammar_from_first_token_changes_nothing(client: VllmClient, engine: FakeEngine) -> None:
    """Our engine runs no reasoning parser: a constraint always starts at the first generated token."""
    await client.generate_all(make_request("a", stream=False, max_tokens=1, regex="[ab]"))
    await client.generate_all(make_request("b", stream=False, max_tokens=1, regex="[ab]",
                                           grammar_from_first_token=True))
    first, second = engine.received
    assert first.structured_output == second.structured_output
    assert first.structured_output is not None


@pytest.mark.parametrize(("params", "field"), [
    ({"json_schema": ""}, "json_schema"),
    ({"regex": "  "}, "regex"),
    ({"choice": pb.ChoiceConstraint()}, "choice"),
    ({"choice": pb.ChoiceConstraint(choices=["yes", ""])}, "choice"),
    ({"json_schema": json.dumps({"description": "x" * MAX_STRUCTURED_OUTPUT_BYTES})}, "json_schema"),
], ids=["empty_schema", "blank_regex", "no_choices", "empty_choice", "too_large"])
async def test_malformed_constraints_are_refused_before_admission(
    client: VllmClient, engine: FakeEngine, params: dict[str, Any], field: str
) -> None:
    with pytest.raises(GRPCError) as info:
        await client.generate_all(make_request(stream=True, max_tokens=2, **params))
    assert info.value.status is Status.INVALID_ARGUMENT
    assert (info.value.message or "").startswith(f"{field}: ")
    assert not engine.received


@pytest.mark.parametrize("stream", [False, True])
async def test_a_constraint_refused_after_admission_ends_the_call_before_its_headers(
    client: VllmClient, engine: FakeEngine, stream: bool
) -> None:
    """The engine compiles a constraint after admission; its error must still be a trailers-only status
    (what smg answers with HTTP 400), not an error after the headers of a stream that has begun."""
    engine.rejects_constraints = True
    request = make_request(stream=stream, max_tokens=2, json_schema=SCHEMA)
    async with client.generate(request) as call:
        await call.send_message(request, end=True)
        with pytest.raises(GRPCError) as info:
            await call.recv_initial_metadata()
    assert info.value.status is Status.INVALID_ARGUMENT
    assert (info.value.message or "").startswith("json_schema: ")
    assert not engine.requests


async def test_a_constrained_stream_sends_every_token_in_a_chunk(client: VllmClient) -> None:
    """Its headers wait for its first output; nothing else changes."""
    messages = await client.generate_all(make_request(stream=True, max_tokens=5, n=2, regex="[ab]+"))
    for index in (0, 1):
        mine = [m for m in messages if getattr(m, m.WhichOneof("response")).index == index]
        assert [m.WhichOneof("response") for m in mine] == ["chunk"] * 5 + ["complete"]
        assert [t for m in mine[:-1] for t in m.chunk.token_ids] == expected_tokens(index, 5)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_dead_end_finishes_as_stop(client: VllmClient, engine: FakeEngine, stream: bool) -> None:
    """vLLM has no name for it; smg knows stop, length, abort and error, and "stop" is what OpenAI clients
    expect of an output that ended where its constraint let it."""
    engine.finish_reason = FinishReason.DEAD_END
    request = make_request(stream=stream, max_tokens=3, json_schema=SCHEMA)
    async with client.generate(request) as call:
        await call.send_message(request, end=True)
        messages = await read_all(call)
    complete = messages[-1].complete
    assert complete.finish_reason == "stop"
    assert list(complete.output_ids) == expected_tokens(0, 3)
    assert not complete.HasField("matched_token_id")


async def test_server_info_says_where_constraints_start(client: VllmClient) -> None:
    info = await client.unary("GetServerInfo", pb.GetServerInfoRequest(), pb.GetServerInfoResponse)
    assert info.constrained_decoding_start == "first_token"
    assert info.engine_reasoning_parser == ""
