"""Structural tags as JSON (vLLM's legacy form and xgrammar's format tree): the grammar each becomes, checked
by llguidance against the tiny model's tokenizer, the shapes that are refused (with the JSON path they name),
and a constrained request through the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.structured.compiler import PARSER_LIMITS, load_llg_tokenizer
from engine_server.engine.structured.structural_tag import MAX_DEPTH, grammar_of_structural_tag_json
from engine_server.engine.types import (
    EngineRequest,
    FinishReason,
    RequestError,
    SamplingParams,
    StructuredOutput,
    StructuredOutputKind,
)
from engine_testutil import run

FIELD = "structural_tag"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CALL = '{"city":"Paris","days":3}'


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> llguidance.LLTokenizer:
    config = json.loads((model_dir / "config.json").read_text())
    return load_llg_tokenizer(str(model_dir), vocab_size=config["vocab_size"],
                              eos_token_ids=(config["eos_token_id"],))


def accepts(tokenizer: llguidance.LLTokenizer, spec: dict[str, Any], text: str) -> bool:
    """Whether the grammar of `spec` compiles (under the engine's limits) and matches all of `text`, ending
    complete."""
    grammar = grammar_of_structural_tag_json(FIELD, json.dumps(spec))
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


def check(tokenizer: llguidance.LLTokenizer, spec: dict[str, Any], good: list[str], bad: list[str]) -> None:
    for text in good:
        assert accepts(tokenizer, spec, text), f"should match: {text!r}"
    for text in bad:
        assert not accepts(tokenizer, spec, text), f"should not match: {text!r}"


def json_schema(schema: Any = WEATHER) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema}


def tag(name: str, schema: Any = WEATHER, end: str | list[str] = "</function>") -> dict[str, Any]:
    return {"begin": f"<function={name}>", "content": json_schema(schema), "end": end}


def triggered(*, at_least_one: bool = False, stop_after_first: bool = False) -> dict[str, Any]:
    return {"type": "triggered_tags", "triggers": ["<function="], "tags": [tag("get_weather")],
            "at_least_one": at_least_one, "stop_after_first": stop_after_first}


def xgrammar(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}


WRONG_CALLS = [
    '<function=get_time>{"city":"Paris","days":3}</function>',  # no such tool
    '<function=get_weather>{"city":"Oslo","days":3}</function>',  # not in the enum
    '<function=get_weather>{"city":"Paris"}</function>',  # a required key missing
    '<function=get_weather>{"city":"Paris","days":3,</function>',  # not JSON
    f"<function=get_weather>{CALL}",  # no end tag
    f"<function=get_weather>{CALL}</func>",
]


# 1) vLLM's legacy form

@pytest.mark.parametrize("with_type", [True, False])
def test_legacy_form_constrains_calls_inside_free_text(tokenizer: llguidance.LLTokenizer,
                                                       with_type: bool) -> None:
    spec: dict[str, Any] = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER,
                                            "end": "</function>"}], "triggers": ["<function="]}
    if with_type:
        spec["type"] = "structural_tag"
    call = f"<function=get_weather>{CALL}</function>"
    check(tokenizer, spec,
          good=["", "No tool needed.", f"Let me look. {call}", f"{call} and {call} done.", "a <functio"],
          bad=[f"Let me look. {w}" for w in WRONG_CALLS])


def test_legacy_trigger_is_text_not_a_special_token(tokenizer: llguidance.LLTokenizer) -> None:
    # "<tool_call>" is no token of the tiny model: it is matched as characters
    spec = {"structures": [{"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "schema": WEATHER,
                            "end": "}\n</tool_call>"}], "triggers": ["<tool_call>"]}
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {CALL}}}\n</tool_call>'
    check(tokenizer, spec, good=[f"ok {call}"],
          bad=[f'<tool_call>\n{{"name": "get_time", "arguments": {CALL}}}\n</tool_call>', call[:-3]])


# 2) xgrammar's format tree

def test_triggered_tags_free_text_around_calls(tokenizer: llguidance.LLTokenizer) -> None:
    call = f"<function=get_weather>{CALL}</function>"
    check(tokenizer, xgrammar(triggered()), good=["", "hi", f"hi {call} bye {call}"],
          bad=[f"hi {w}" for w in WRONG_CALLS])


def test_triggered_tags_at_least_one_starts_with_a_call(tokenizer: llguidance.LLTokenizer) -> None:
    call = f"<function=get_weather>{CALL}</function>"
    check(tokenizer, xgrammar(triggered(at_least_one=True)), good=[call, f"{call} then text {call}"],
          bad=["", "hi", f"hi {call}", *WRONG_CALLS])


def test_triggered_tags_stop_after_first(tokenizer: llguidance.LLTokenizer) -> None:
    call = f"<function=get_weather>{CALL}</function>"
    check(tokenizer, xgrammar(triggered(stop_after_first=True)), good=["", "hi", f"hi {call}"],
          bad=[f"hi {call} more", f"{call}{call}"])
    check(tokenizer, xgrammar(triggered(at_least_one=True, stop_after_first=True)), good=[call],
          bad=["", f"hi {call}", f"{call} more", f"{call}{call}"])


def test_think_then_tool_calls(tokenizer: llguidance.LLTokenizer) -> None:
    spec = xgrammar({"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"},
        triggered()]})
    call = f"<function=get_weather>{CALL}</function>"
    check(tokenizer, spec, good=["<think></think>", f"<think>a < b </thin</think>sure {call}"],
          bad=["", "no think", "<think>unfinished", f"<think>x</think>{WRONG_CALLS[0]}"])


def test_two_triggers_kimi_k2_style(tokenizer: llguidance.LLTokenizer) -> None:
    def kimi(begin: str) -> dict[str, Any]:
        return {"begin": f"{begin}<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>",
                "content": {"type": "json_schema", "json_schema": WEATHER}, "end": "<|tool_call_end|>"}
    spec = xgrammar({"type": "triggered_tags", "triggers": ["<|tool_calls_section_begin|>",
                                                            "<|tool_call_begin|>"],
                     "tags": [kimi("<|tool_calls_section_begin|>"), kimi("")]})
    first = f"<|tool_calls_section_begin|>{kimi('')['begin']}{CALL}<|tool_call_end|>"
    again = f"{kimi('')['begin']}{CALL}<|tool_call_end|>"
    check(tokenizer, spec, good=[f"x {first}{again}"], bad=[first.replace("get_weather", "get_time")])


def test_tags_with_separator_mistral_style(tokenizer: llguidance.LLTokenizer) -> None:
    inner = {"begin": '{"name": "get_weather", "arguments": ', "content": json_schema(), "end": "}"}
    calls = {"type": "tags_with_separator", "tags": [inner], "separator": ", ", "at_least_one": True}
    spec = xgrammar({"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"],
                     "tags": [{"begin": "[TOOL_CALLS] [", "content": calls, "end": "]"}]})
    one = f'{{"name": "get_weather", "arguments": {CALL}}}'
    check(tokenizer, spec, good=[f"[TOOL_CALLS] [{one}]", f"ok [TOOL_CALLS] [{one}, {one}] done"],
          bad=["[TOOL_CALLS] []", f"[TOOL_CALLS] [{one},{one}]", f"[TOOL_CALLS] [{one}"])


@pytest.mark.parametrize(("at_least_one", "stop_after_first", "good", "bad"), [
    (False, False, ["", "<a>", "<a>,<a>,<a>"], ["<a><a>", ",<a>"]),
    (True, False, ["<a>", "<a>,<a>"], ["", "<a>,"]),
    (False, True, ["", "<a>"], ["<a>,<a>"]),
    (True, True, ["<a>"], ["", "<a>,<a>"]),
])
def test_tags_with_separator_flags(tokenizer: llguidance.LLTokenizer, at_least_one: bool,
                                   stop_after_first: bool, good: list[str], bad: list[str]) -> None:
    spec = xgrammar({"type": "tags_with_separator", "separator": ",", "at_least_one": at_least_one,
                     "stop_after_first": stop_after_first,
                     "tags": [{"begin": "<", "content": {"type": "const_string", "value": "a"}, "end": ">"}]})
    check(tokenizer, spec, good, bad)


def test_const_or_json_and_end_lists(tokenizer: llguidance.LLTokenizer) -> None:
    spec = xgrammar({"type": "or", "elements": [
        {"type": "const_string", "value": 'say "hi"\\\n\u00e9\U0001f600'},
        {"type": "tag", "begin": "<r>", "content": {"type": "any_text"}, "end": ["</r>", "</answer>"]},
        {"type": "json_schema", "json_schema": WEATHER, "style": "json"}]})
    check(tokenizer, spec, good=['say "hi"\\\n\u00e9\U0001f600', "<r>x</answer>", "<r></r>", CALL],
          bad=['say "hi"', "<r>x</r>y", "<r>x", '{"city": "Paris", "days": 3}'])


def test_or_and_empty_strings(tokenizer: llguidance.LLTokenizer) -> None:
    a, empty = {"type": "const_string", "value": "a"}, {"type": "const_string", "value": ""}
    check(tokenizer, xgrammar({"type": "or", "elements": [a, a]}), good=["a"], bad=["", "aa"])
    check(tokenizer, xgrammar({"type": "or", "elements": [a, empty]}), good=["a", ""], bad=["aa"])
    check(tokenizer, xgrammar(empty), good=[""], bad=["a"])
    check(tokenizer, xgrammar({"type": "tag", "begin": "", "content": a, "end": ["", "!"]}), good=["a", "a!"],
          bad=["", "!"])


def test_json_whitespace_as_the_schema_asks(tokenizer: llguidance.LLTokenizer) -> None:
    flexible = {**WEATHER, "x-guidance": {"whitespace_flexible": True}}
    spaced = '{"city": "Paris", "days": 3}'
    check(tokenizer, xgrammar({"type": "json_schema", "json_schema": WEATHER}), good=[CALL], bad=[spaced])
    check(tokenizer, xgrammar({"type": "json_schema", "json_schema": flexible}), good=[CALL, spaced], bad=[])
    check(tokenizer, xgrammar({"type": "json_schema", "json_schema": True}), good=["[1]", '"s"'], bad=["x"])


def test_text_stopped_by_the_next_constant(tokenizer: llguidance.LLTokenizer) -> None:
    # Kimi-K3's shape: text that cannot contain '"' or '<|', then a constant starting with '"'
    spec = xgrammar({"type": "sequence", "elements": [
        {"type": "const_string", "value": 'key="'},
        {"type": "any_text", "excludes": ['"', "<|"]},
        {"type": "tag", "begin": '"<|sep|>', "content": {"type": "any_text"}, "end": "<|close|>"},
        {"type": "const_string", "value": "!"}]})
    check(tokenizer, spec, good=['key=""<|sep|><|close|>!', 'key="a<b|c"<|sep|>v"<|close|>!'],
          bad=['key="a"b"<|sep|><|close|>!', 'key="a<|b"<|sep|><|close|>!', 'key="a"<|sep|><|close|>'])


def test_text_inside_a_tag_cannot_contain_the_tag_end(tokenizer: llguidance.LLTokenizer) -> None:
    # xgrammar's rule: the end of the nearest tag is excluded from free text anywhere inside it
    content = {"type": "sequence", "elements": [{"type": "any_text", "excludes": ["|"]},
                                                {"type": "const_string", "value": "|"}, {"type": "any_text"}]}
    spec = xgrammar({"type": "tag", "begin": "<a>", "end": "</a>", "content": content})
    check(tokenizer, spec, good=["<a>x|y</a>", "<a>|</a>"], bad=["<a>x</a>|y</a>", "<a>x|y</a>z"])


# 3) refused shapes, each naming where it is

def deep(depth: int) -> dict[str, Any]:
    fmt: dict[str, Any] = {"type": "const_string", "value": "x"}
    for _ in range(depth - 1):
        fmt = {"type": "sequence", "elements": [fmt]}
    return xgrammar(fmt)


ANY = {"type": "any_text"}
SCHEMA = json_schema()
LEGACY = {"structures": [{"begin": "<f>", "schema": WEATHER, "end": "</f>"}], "triggers": ["<f"]}


@pytest.mark.parametrize(("spec", "field", "words"), [
    ("{", "", "not valid JSON"),
    ("[" * 100_000, "", "not valid JSON"),
    ([], "", "JSON object"),
    ({"type": "structural_tag"}, "", '"format"'),
    ({"type": "regex", "format": ANY}, ".type", "'structural_tag'"),
    ({**LEGACY, "structures": []}, ".structures", "non-empty"),
    ({**LEGACY, "triggers": []}, ".triggers", "at least one"),
    ({**LEGACY, "triggers": [""]}, ".triggers", "non-empty strings"),
    ({"structures": LEGACY["structures"]}, ".triggers", "list"),
    ({**LEGACY, "triggers": ["<g"]}, ".structures[0].begin", "exactly one of the triggers"),
    ({**LEGACY, "structures": [{"begin": "<f>", "schema": [], "end": ""}]}, ".structures[0].schema",
     "Schema"),
    ({**LEGACY, "structures": [{"begin": "<f>", "schema": "{", "end": ""}]}, ".structures[0].schema",
     "JSON"),
    ({**LEGACY, "structures": [{"begin": "<f>", "schema": {}}]}, ".structures[0].end", "string"),
    ({**LEGACY, "extra": 1}, ".extra", "not a known key"),
    (xgrammar({"value": "x"}), ".format.type", "must be a string"),
    (xgrammar({"type": "regex", "pattern": "a+"}), ".format.type", "'regex' is not supported"),
    (xgrammar({"type": "sequence", "elements": [ANY, ANY, {"type": "dispatch"}]}),
     ".format.elements[2].type", "'dispatch' is not supported"),
    (xgrammar({"type": "or", "elements": []}), ".format.elements", "non-empty"),
    (xgrammar({"type": "const_string", "value": 3}), ".format.value", "string"),
    (xgrammar({**SCHEMA, "style": "qwen_xml"}), ".format.style", '"json"'),
    (xgrammar({**SCHEMA, "any_order": True}), ".format.any_order", "false"),
    (xgrammar({"type": "json_schema", "json_schema": False}), ".format.json_schema", "JSON Schema"),
    (xgrammar({"type": "any_text", "max_tokens": 10}), ".format.max_tokens", "null"),
    (xgrammar({"type": "any_text", "excludes": "x"}), ".format.excludes", "list"),
    (xgrammar({**ANY, "color": "red"}), ".format.color", "not a known key"),
    (xgrammar({"type": "tag", "begin": {"type": "token", "token": 5}, "content": ANY, "end": "x"}),
     ".format.begin", "token"),
    (xgrammar({"type": "tag", "begin": "<a>", "content": ANY, "end": []}), ".format.end", "non-empty list"),
    (xgrammar({"type": "tag", "begin": "<a>", "content": ANY, "end": ""}), ".format.end", "non-empty end"),
    (xgrammar({"type": "tag", "begin": "<a>", "content": ANY, "end": ["</a", "</a>"]}), ".format.end",
     "starts another"),
    (xgrammar({**triggered(), "at_least_one": 1}), ".format.at_least_one", "boolean"),
    (xgrammar({**triggered(), "triggers": ["<function=", "<fun"]}), ".format.tags[0].begin", "exactly one"),
    (xgrammar({**triggered(), "triggers": ["<function=", "<x"]}), ".format.triggers", "starts none"),
    (xgrammar({**triggered(), "tags": [{**tag("f"), "type": "or"}]}), ".format.tags[0].type", "'tag'"),
    (xgrammar({**triggered(), "excludes": ["n="]}), ".format.triggers", "overlaps"),
    (xgrammar({"type": "triggered_tags", "triggers": ["<f=", "=", "x<f="], "tags": [
        {**tag("a"), "begin": "<f=a>"}, {**tag("b"), "begin": "=b>"}, {**tag("c"), "begin": "x<f=c>"}]}),
     ".format.triggers", "overlaps"),
    (xgrammar({"type": "tag", "begin": "<a>", "end": "=</a>", "content": triggered()}),
     ".format.content.triggers", "overlaps"),
    (xgrammar({"type": "sequence", "elements": [ANY, SCHEMA]}), ".format.elements[0]", "must be last"),
    (xgrammar({"type": "sequence", "elements": [ANY, {"type": "const_string", "value": "!"}]}),
     ".format.elements[0]", "could also occur"),
    (xgrammar({"type": "sequence", "elements": [triggered(), {"type": "const_string", "value": "!"}]}),
     ".format.elements[0]", "could also occur"),
    (deep(MAX_DEPTH + 1), ".format" + ".elements[0]" * MAX_DEPTH, "nest more than"),
])
def test_refused(spec: Any, field: str, words: str) -> None:
    with pytest.raises(RequestError) as info:
        grammar_of_structural_tag_json(FIELD, spec if isinstance(spec, str) else json.dumps(spec))
    assert info.value.field_name == FIELD + field
    assert words in info.value.detail


def test_deepest_allowed_tree_compiles(tokenizer: llguidance.LLTokenizer) -> None:
    assert accepts(tokenizer, deep(MAX_DEPTH), "x")


# 4) through the engine: a random-weight model made to call the tool

@pytest.mark.parametrize("stop_after_first", [False, True])
@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.5, 7)])
def test_engine_output_is_a_valid_call(engine: LLMEngine, model_dir: Path, temperature: float,
                                       seed: int | None, stop_after_first: bool) -> None:
    from transformers import AutoTokenizer

    spec = json.dumps(xgrammar(triggered(at_least_one=True, stop_after_first=stop_after_first)))
    request = EngineRequest(
        f"st-{temperature}-{stop_after_first}", (0, 11, 12, 13, 14),
        SamplingParams(temperature=temperature, seed=seed, max_tokens=120),
        structured_output=StructuredOutput(StructuredOutputKind.STRUCTURAL_TAG_JSON, spec=spec))
    got = run(engine, [request])
    key = (request.request_id, 0)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = str(hf_tokenizer.decode(got.tokens[key], skip_special_tokens=True))
    begin = "<function=get_weather>"
    assert text.startswith(begin), text
    arguments, end, rest = text[len(begin):].partition("</function>")
    assert end, f"no end tag in {text!r}"
    jsonschema.validate(json.loads(arguments), WEATHER)
    if stop_after_first:  # the call completes the grammar: nothing may follow
        assert (rest, got.finish[key]) == ("", FinishReason.STOP)
