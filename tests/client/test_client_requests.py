"""build_generate_request: each knob lands in its own field; unset stays unset on the wire (no network)."""

from __future__ import annotations

import dataclasses

import pytest
from engine_client import GenerateParams
from engine_client._requests import build_generate_request
from engine_proto.engine.v1 import generate_pb2
from google.protobuf.message import Message

SUB_MESSAGES: dict[str, type[Message]] = {
    "sampling": generate_pb2.SamplingParams,
    "stopping": generate_pb2.StoppingCriteria,
    "output": generate_pb2.OutputOptions,
}
# The knobs outside the sampling / stopping / output sub-messages: input rendering, the constraint
# (structured_output, tested in test_client_structured.py), cache isolation, priority and the LoRA adapter.
TOP_LEVEL_KNOBS = {
    "add_special_tokens", "add_generation_prompt", "structured_output", "cache_salt", "priority", "adapter",
}


def build(**knobs: object) -> generate_pb2.GenerateRequest:
    params = GenerateParams(**knobs)  # type: ignore[arg-type]
    return build_generate_request("Hi", token_ids=None, messages=None, request_id="r", stream=True,
                                  params=params)


def sub_message_of(knob: str) -> str:
    return next(name for name, message in SUB_MESSAGES.items() if knob in message.DESCRIPTOR.fields_by_name)


def test_every_sub_message_field_is_a_knob_and_every_knob_a_field() -> None:
    knobs = {f.name for f in dataclasses.fields(GenerateParams)} - TOP_LEVEL_KNOBS
    fields = {f.name for message in SUB_MESSAGES.values() for f in message.DESCRIPTOR.fields}
    assert knobs == fields


# One value per knob that the wire must carry although it is zero or False where the field has presence.
SENT = {
    "max_tokens": 1, "min_tokens": 2, "stop": "x", "stop_token_ids": [3], "ignore_eos": True,
    "include_stop_string": True, "temperature": 0.0, "top_p": 0.0, "top_k": 0, "min_p": 0.0,
    "repetition_penalty": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 0,
    "logit_bias": {7: -1.5}, "n": 1, "logprobs": 0, "prompt_logprobs": 0, "return_text": False,
    "skip_special_tokens": False,
}


@pytest.mark.parametrize("knob", sorted(SENT))
def test_a_set_knob_creates_only_its_own_field(knob: str) -> None:
    req = build(**{knob: SENT[knob]})
    owner = sub_message_of(knob)
    for name in SUB_MESSAGES:
        assert req.HasField(name) == (name == owner), name  # type: ignore[arg-type]
    sub = getattr(req, owner)
    assert [f.name for f, _ in sub.ListFields()] == [knob]
    value = getattr(GenerateParams(**{knob: SENT[knob]}), knob)  # type: ignore[arg-type]
    assert sub == SUB_MESSAGES[owner](**{knob: value})


@pytest.mark.parametrize("knobs", [
    {},
    {"min_tokens": 0, "ignore_eos": False, "include_stop_string": False, "stop": (), "stop_token_ids": ()},
    {"logit_bias": {}},
])
def test_unset_and_zero_non_optional_knobs_leave_every_sub_message_unset(knobs: dict[str, object]) -> None:
    req = build(**knobs)
    for name in (*SUB_MESSAGES, "add_special_tokens", "structured_output"):
        assert not req.HasField(name), name  # type: ignore[arg-type]


def test_cache_salt_and_priority_are_sent_at_the_top_level() -> None:
    req = build(cache_salt="tenant-a", priority=-3)
    assert (req.cache_salt, req.priority) == ("tenant-a", -3)
    for name in SUB_MESSAGES:
        assert not req.HasField(name), name  # type: ignore[arg-type]
    unset = build()
    assert (unset.cache_salt, unset.priority) == ("", 0)


def test_adapter_is_sent_at_the_top_level() -> None:
    assert build(adapter="sql").adapter == "sql"
    assert build().adapter == ""
    with pytest.raises(TypeError, match="adapter"):
        build(adapter=b"sql")


@pytest.mark.parametrize(("knobs", "error"), [
    ({"priority": 2**31}, ValueError), ({"priority": -(2**31) - 1}, ValueError),
    ({"priority": True}, ValueError), ({"priority": 1.5}, ValueError), ({"cache_salt": b"x"}, TypeError),
])
def test_bad_cache_salt_or_priority_is_refused_before_the_call(knobs: dict[str, object],
                                                               error: type[Exception]) -> None:
    with pytest.raises(error):
        GenerateParams(**knobs)  # type: ignore[arg-type]


def test_add_special_tokens_false_is_sent() -> None:
    req = build(add_special_tokens=False)
    assert req.HasField("add_special_tokens")
    assert req.add_special_tokens is False
