"""Requests drawn within every documented range of engine.v1 (generate.proto's comments) must succeed.

The other fuzz tests mostly reach the checks that reject a request; these reach the engine with every knob
at once (n, penalties, logit bias, top-k/p/min-p, stop strings and ids, logprobs, prompt logprobs, text and
chat input) and check what the contract promises of the stream (fuzz_calls.check_generated), and that a
seeded request gives the same tokens again.
"""

from __future__ import annotations

import pytest
from engine_proto.engine.v1 import generate_pb2
from fuzz_calls import (
    ENGINE_PREFIX,
    VOCAB_SIZE,
    Outcome,
    call_and_settle,
    check_generated,
    run,
)
from fuzz_settings import fuzz_settings
from grpclib.const import Status
from hypothesis import given
from hypothesis import strategies as st

_ids = st.integers(0, VOCAB_SIZE - 1)
_unit = st.floats(0.0, 1.0)
_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40)
# Short stop strings from a few letters, so they do match the tiny model's output now and then
_stop = st.text(st.sampled_from("aeiostn ."), min_size=1, max_size=3)


def _maybe(strategy: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.one_of(st.none(), strategy)


@st.composite
def valid_requests(draw: st.DrawFn) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(stream=draw(st.booleans()))
    match draw(st.sampled_from(["token_ids", "text", "chat"])):
        case "token_ids":
            request.token_ids.ids.extend(draw(st.lists(_ids, min_size=1, max_size=200)))
        case "text":
            request.text = draw(_text)
            if (add := draw(_maybe(st.booleans()))) is not None:
                request.add_special_tokens = bool(add)
        case _:
            for _ in range(draw(st.integers(1, 3))):
                request.chat.messages.add(role=draw(st.sampled_from(["system", "user", "assistant"])),
                                          content=draw(_text))
            if (add := draw(_maybe(st.booleans()))) is not None:
                request.chat.add_generation_prompt = bool(add)

    sampling = request.sampling
    knobs: dict[str, st.SearchStrategy[object]] = {
        "temperature": st.one_of(st.just(0.0), st.floats(0.0, 2.0)),
        "top_p": st.floats(0.01, 1.0),
        "top_k": st.integers(0, VOCAB_SIZE),
        "min_p": _unit,
        "repetition_penalty": st.floats(0.1, 3.0),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "seed": st.integers(0, (1 << 64) - 1),
        "n": st.integers(1, 16),
    }
    for name, values in knobs.items():
        if (value := draw(_maybe(values))) is not None:
            setattr(sampling, name, value)
    sampling.logit_bias.update(draw(st.dictionaries(_ids, st.floats(-100.0, 100.0), max_size=8)))

    stopping = request.stopping
    stopping.max_tokens = draw(st.integers(1, 24))
    stopping.min_tokens = draw(st.integers(0, stopping.max_tokens))
    stopping.stop.extend(draw(st.lists(_stop, max_size=4)))
    stopping.stop_token_ids.extend(draw(st.lists(_ids, max_size=4)))
    stopping.ignore_eos = draw(st.booleans())
    stopping.include_stop_string = draw(st.booleans())

    output = request.output
    for name, values in {"logprobs": st.integers(0, 20), "prompt_logprobs": st.integers(0, 20),
                         "return_text": st.booleans(), "skip_special_tokens": st.booleans()}.items():
        if (value := draw(_maybe(values))) is not None:
            setattr(output, name, value)
    return request


pytestmark = pytest.mark.usefixtures("server_log_clean")


def generate(port: int, request: generate_pb2.GenerateRequest) -> Outcome:
    # NOTE: read to the end: at most 16 completions x 24 tokens, however they are split into messages
    return run(call_and_settle(port, ENGINE_PREFIX + "Generate", request, generate_pb2.GenerateResponse,
                               streaming=True, cancel_after=1 << 20))


def token_ids(outcome: Outcome) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for reply in outcome.replies:
        for chunk in reply.completions:
            ids.setdefault(chunk.index, []).extend(chunk.token_ids)
    return ids


@fuzz_settings(ci_examples=150)
@given(valid_requests())
def test_valid_request_succeeds(port: int, request: generate_pb2.GenerateRequest) -> None:
    outcome = generate(port, request)
    assert outcome.status == Status.OK, f"{outcome.status.name}: {outcome.message!r} for\n{request}"
    check_generated(request, outcome)
    is_greedy = request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    if request.sampling.HasField("seed") or is_greedy:
        # "the same seed and request give the same tokens" (generate.proto); greedy likewise
        assert token_ids(generate(port, request)) == token_ids(outcome)
