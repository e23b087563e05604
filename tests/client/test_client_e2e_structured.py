"""Structured output through both clients against a real engine-server (the tiny random-weight model).

A random model left alone writes noise; constrained, its output must be in the language every time: JSON that
parses and validates against the schema, one of the choices, a regex match. A constraint the server cannot
compile is INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from engine_client import (
    AsyncEngineClient,
    Choice,
    EngineClient,
    FinishReason,
    Grammar,
    InvalidRequestError,
    JsonSchema,
    Regex,
    StatusCode,
    StructuralTag,
    Tag,
)
from serverproc import RunningServer

# Bounded: every completion closes well within MAX_TOKENS (a handful of tokens of keys, one enum value, one
# digit), so LENGTH would mean the constraint was not applied.
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "n"],
    "additionalProperties": False,
}
MAX_TOKENS = 64
PROMPT = "Answer in JSON:"
CHOICES = ["red", "green", "blue"]


def check_schema_output(text: str, finish_reason: FinishReason | None) -> None:
    assert finish_reason is FinishReason.STOP, (finish_reason, text)
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    assert set(value) == {"answer", "n"}


async def test_async_streamed_json_schema_output_validates(engine_server: RunningServer) -> None:
    async with AsyncEngineClient(engine_server.target, timeout=60) as client:
        # three seeded samples, each constrained on its own, streamed token by token
        stream = client.generate(PROMPT, max_tokens=MAX_TOKENS, n=3, seed=7,
                                 structured_output=JsonSchema(SCHEMA))
        result = await stream.collect()
    assert len(result.completions) == 3
    for completion in result.completions:
        check_schema_output(completion.text, completion.finish_reason)


def test_sync_json_schema_output_validates(engine_server: RunningServer) -> None:
    with EngineClient(engine_server.target, timeout=60) as client:
        from_data = client.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                    structured_output=JsonSchema(SCHEMA))
        # the same schema as JSON text is the same constraint: greedy output equal
        from_text = client.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                    structured_output=JsonSchema(json.dumps(SCHEMA, indent=2)))
    check_schema_output(from_data.text, from_data.finish_reason)
    assert from_text.token_ids == from_data.token_ids


async def test_choice_returns_one_of_the_choices_both_clients(engine_server: RunningServer) -> None:
    async with AsyncEngineClient(engine_server.target, timeout=60) as aclient:
        streamed = await aclient.complete(PROMPT, max_tokens=MAX_TOKENS, n=4, seed=1,
                                          structured_output=Choice(CHOICES))
    with EngineClient(engine_server.target, timeout=60) as client:
        whole = client.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                structured_output=Choice(CHOICES))
    for completion in (*streamed.completions, *whole.completions):
        assert completion.text in CHOICES
        assert completion.finish_reason is FinishReason.STOP


def test_regex_and_grammar_outputs_are_in_their_language(engine_server: RunningServer) -> None:
    with EngineClient(engine_server.target, timeout=60) as client:
        by_regex = client.complete(PROMPT, max_tokens=MAX_TOKENS, seed=3,
                                   structured_output=Regex(r"[0-9]{3}-[a-z]{2}"))
        by_grammar = client.complete(PROMPT, max_tokens=MAX_TOKENS, seed=3,
                                     structured_output=Grammar('start: "id=" NUM ";"\nNUM: /[1-9][0-9]?/\n'))
        tagged = client.complete(PROMPT, max_tokens=8, seed=3, structured_output=StructuralTag(
            [Tag("<call=f>", SCHEMA, "</call>")], triggers=["<call="]))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", by_regex.text), by_regex.text
    assert by_regex.finish_reason is FinishReason.STOP
    assert re.fullmatch(r"id=[1-9][0-9]?;", by_grammar.text), by_grammar.text
    assert by_grammar.finish_reason is FinishReason.STOP
    # free text (the random model is unlikely to write the trigger): the request is accepted and runs
    assert tagged.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


async def test_a_bad_regex_is_invalid_argument_naming_the_field(engine_server: RunningServer) -> None:
    async with AsyncEngineClient(engine_server.target, timeout=60) as aclient:
        with pytest.raises(InvalidRequestError) as async_error:
            await aclient.complete(PROMPT, max_tokens=MAX_TOKENS, structured_output=Regex("(a"))
    with EngineClient(engine_server.target, timeout=60) as client:
        with pytest.raises(InvalidRequestError) as sync_error:
            for _ in client.generate(PROMPT, max_tokens=MAX_TOKENS, structured_output=Regex("(a")):
                pass
        with pytest.raises(InvalidRequestError) as schema_error:
            client.complete(PROMPT, structured_output=JsonSchema({"type": "array", "uniqueItems": True}))
    for error in (async_error.value, sync_error.value):
        assert error.code is StatusCode.INVALID_ARGUMENT
        assert error.message.startswith("structured_output.regex:"), error.message
        assert error.request_id is not None
    assert schema_error.value.code is StatusCode.INVALID_ARGUMENT
    assert "structured_output.json_schema" in schema_error.value.message
    assert "uniqueItems" in schema_error.value.message
