"""validate_request's token id checks: the fast path (all ints in range) and the exact error for each kind of
bad id, wherever it sits."""

from __future__ import annotations

import re
from typing import Any

import pytest
from engine_server.engine.model_info import ModelInfo
from engine_server.engine.types import EngineRequest, RequestError, SamplingParams
from engine_server.frontend.validation import validate_request

VOCAB = 100
INFO = ModelInfo(
    model_path="/m", architecture="LlamaForCausalLM", task="generate", max_model_len=64, vocab_size=VOCAB,
    bos_token_id=1, eos_token_ids=(2,), pad_token_id=None, dtype="float32", device="cpu", embedding_dim=None,
    num_parameters=1, num_kv_blocks=8, block_size=16,
)


def test_in_range_ids_pass() -> None:
    validate_request(EngineRequest("r", (0, 5, VOCAB - 1), SamplingParams(stop_token_ids=(3,))), INFO)


@pytest.mark.parametrize(("bad", "message"), [
    (VOCAB, f"[2] = {VOCAB} is outside the vocabulary"),
    (-1, "[2] = -1 is outside the vocabulary"),
    (True, "[2] must be an integer token id, got True"),
    (2.0, "[2] must be an integer token id, got 2.0"),
    ("7", "[2] must be an integer token id, got '7'"),
])
def test_each_bad_id_is_named_with_its_position(bad: Any, message: str) -> None:
    with pytest.raises(RequestError, match=re.escape(f"prompt_token_ids: {message}")):
        validate_request(EngineRequest("r", (4, 5, bad, 6), SamplingParams()), INFO)
    with pytest.raises(RequestError, match="stop_token_ids"):
        validate_request(EngineRequest("r", (4,), SamplingParams(stop_token_ids=(1, bad))), INFO)


def test_logit_bias_ids_are_checked_against_the_vocabulary_and_for_repeats() -> None:
    validate_request(EngineRequest("r", (4,), SamplingParams(logit_bias=((3, 1.0), (VOCAB - 1, -2.0)))), INFO)
    with pytest.raises(RequestError, match=re.escape(f"logit_bias: [1] = {VOCAB} is outside the vocabulary")):
        validate_request(EngineRequest("r", (4,), SamplingParams(logit_bias=((3, 1.0), (VOCAB, 1.0)))), INFO)
    with pytest.raises(RequestError, match="logit_bias: has a token id more than once"):
        validate_request(EngineRequest("r", (4,), SamplingParams(logit_bias=((3, 1.0), (3, 2.0)))), INFO)
