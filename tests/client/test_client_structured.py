"""Structured output in engine-client without a server: the typed constraints, the request message they build,
and the finish reason a dead end converts to."""

from __future__ import annotations

import json

import pytest
from engine_client import (
    Choice,
    FinishReason,
    GenerateParams,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    StructuralTag,
    StructuredOutput,
    Tag,
    _convert,
)
from engine_client._requests import build_generate_call
from engine_proto.engine.v1 import generate_pb2

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
SCHEMA_TEXT = '{"type":"object","properties":{"answer":{"enum":["yes","no"]}},"required":["answer"]}'


def build(constraint: StructuredOutput | None, **knobs: object) -> generate_pb2.GenerateRequest:
    options = {"structured_output": constraint, **knobs}
    return build_generate_call("Hi", token_ids=None, messages=None, request_id="r", stream=True, params=None,
                               options=options)[1]


@pytest.mark.parametrize(("constraint", "expected"), [
    (JsonSchema(SCHEMA), generate_pb2.StructuredOutput(json_schema=SCHEMA_TEXT)),
    (JsonSchema('{"type": "string"}'), generate_pb2.StructuredOutput(json_schema='{"type": "string"}')),
    (JsonSchema(True), generate_pb2.StructuredOutput(json_schema="true")),
    (JsonObject(), generate_pb2.StructuredOutput(json_object=generate_pb2.JsonObject())),
    (Regex(""), generate_pb2.StructuredOutput(regex="")),  # an empty one is the server's to refuse
    (Regex(r"\d{3}"), generate_pb2.StructuredOutput(regex=r"\d{3}")),
    (Grammar('start: "a"+\n'), generate_pb2.StructuredOutput(grammar='start: "a"+\n')),
    (Choice(["yes", "no", "yes"]),
     generate_pb2.StructuredOutput(choice=generate_pb2.Choice(choices=["yes", "no", "yes"]))),
    (StructuralTag([Tag("<f=a>", SCHEMA, "</f>"), Tag("<f=b>")], triggers=["<f="]),
     generate_pb2.StructuredOutput(structural_tag=generate_pb2.StructuralTag(
         tags=[generate_pb2.StructuralTagItem(begin="<f=a>", json_schema=SCHEMA_TEXT,
                                              end="</f>"),
               generate_pb2.StructuralTagItem(begin="<f=b>")],
         triggers=["<f="]))),
])
def test_each_constraint_sets_exactly_its_member_of_the_oneof(
        constraint: StructuredOutput, expected: generate_pb2.StructuredOutput) -> None:
    req = build(constraint)
    assert req.HasField("structured_output")
    assert req.structured_output == expected
    assert req.structured_output.WhichOneof("kind") == expected.WhichOneof("kind")
    # nothing else of the request moves: the other sub-messages stay unset
    assert not req.HasField("sampling")
    assert not req.HasField("stopping")
    assert not req.HasField("output")


def test_no_constraint_leaves_the_field_unset() -> None:
    assert not build(None).HasField("structured_output")
    assert not build(None, max_tokens=4).HasField("structured_output")


def test_keyword_and_params_forms_build_the_same_request() -> None:
    params = GenerateParams(max_tokens=8, structured_output=Choice(["a", "b"]))
    by_params = build_generate_call("Hi", token_ids=None, messages=None, request_id="r", stream=False,
                                    params=params, options={})[1]
    by_keywords = build_generate_call("Hi", token_ids=None, messages=None, request_id="r", stream=False,
                                      params=None, options={"max_tokens": 8,
                                                            "structured_output": Choice(["a", "b"])})[1]
    assert by_params == by_keywords
    # a keyword overrides the constraint of params=, as for every other knob
    overridden = build_generate_call("Hi", token_ids=None, messages=None, request_id="r", stream=False,
                                     params=params, options={"structured_output": JsonObject()})[1]
    assert overridden.structured_output.WhichOneof("kind") == "json_object"


def test_a_schema_given_as_data_is_a_snapshot_compared_by_its_json() -> None:
    schema: dict[str, object] = {"type": "object", "title": "caf\u00e9"}
    constraint = JsonSchema(schema)
    schema["type"] = "array"  # later changes to the dict do not reach what is sent
    assert json.loads(constraint.text) == {"type": "object", "title": "caf\u00e9"}
    assert "\u00e9" in constraint.text  # not escaped: the server's 64 KiB limit counts bytes
    assert constraint == JsonSchema('{"type":"object","title":"caf\u00e9"}')
    assert hash(constraint) == hash(JsonSchema({"type": "object", "title": "caf\u00e9"}))
    params = GenerateParams(structured_output=constraint)
    assert hash(params) == hash(GenerateParams(structured_output=JsonSchema(constraint.text)))
    assert Tag("<a>").text == ""  # no schema: any JSON value


def test_sequences_are_normalised_to_tuples() -> None:
    assert Choice(["a", "b"]).options == ("a", "b")
    tag = StructuralTag([Tag("<a>")], triggers=["<"])
    assert tag.tags == (Tag("<a>"),)
    assert tag.triggers == ("<",)


def test_wrong_types_are_refused_where_they_are_made() -> None:
    with pytest.raises(TypeError, match="options"):
        Choice("yes")  # a bare str is not a list of choices
    with pytest.raises(TypeError, match=r"options\[\]"):
        Choice(["a", 1])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="triggers"):
        StructuralTag([Tag("<a>")], triggers="<")
    with pytest.raises(TypeError, match="tags"):
        StructuralTag([{"begin": "<a>"}], triggers=["<"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="pattern"):
        Regex(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lark"):
        Grammar(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="schema"):
        JsonSchema(["not", "a", "schema"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="schema does not serialize"):
        JsonSchema({"type": object()})
    with pytest.raises(ValueError, match="schema does not serialize"):
        JsonSchema({"maximum": float("inf")})  # not JSON
    with pytest.raises(TypeError, match="begin"):
        Tag(b"<a>")  # type: ignore[arg-type]
    # an OpenAI-style response_format dict is not a constraint: say what to pass instead
    with pytest.raises(TypeError, match="structured_output must be a JsonSchema"):
        GenerateParams(structured_output={"type": "json_object"})  # type: ignore[arg-type]


def test_the_dead_end_finish_reason_converts() -> None:
    resp = generate_pb2.GenerateResponse(request_id="r")
    resp.completions.add(index=0, token_ids=[5], text="{",
                         finish_reason=generate_pb2.FINISH_REASON_CONSTRAINT_DEAD_END)
    [chunk] = _convert.chunks(resp)
    assert chunk.finish_reason is FinishReason.CONSTRAINT_DEAD_END
    assert _convert.finish_reason(generate_pb2.FINISH_REASON_CONSTRAINT_DEAD_END) is not FinishReason.UNKNOWN


def test_every_finish_reason_of_the_contract_has_its_own_member() -> None:
    numbers = [v.number for v in generate_pb2.FinishReason.DESCRIPTOR.values if v.number != 0]
    reasons = [_convert.finish_reason(number) for number in numbers]
    assert None not in reasons
    assert FinishReason.UNKNOWN not in reasons
    assert len(set(reasons)) == len(numbers)
