"""Abort frees everything; invalid requests are refused with the field named; others keep going."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from engine_server.engine.config import EngineConfig
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import (
    EngineOverloaded,
    EngineRequest,
    FinishReason,
    RequestError,
    SamplingParams,
)
from engine_testutil import Collected, reference_greedy


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 1000) for _ in range(length))


def test_abort_running_waiting_and_prefilling_requests_frees_every_block(model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=32,
                                    max_num_seqs=4))
    free_at_start = engine.stats().num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i in range(8):
        engine.add_request(EngineRequest(f"a{i}", _prompt(i, 10 + 9 * i), params))
    n_params = SamplingParams(n=3, temperature=1.0, max_tokens=50)
    engine.add_request(EngineRequest("n", _prompt(99, 20), n_params))
    out = Collected()
    for _ in range(4):
        out.add(engine.step())
    assert engine.stats().num_running > 0
    assert engine.stats().num_waiting > 0
    aborted = engine.abort(["a0", "a3", "a7", "n", "missing"])
    assert aborted == ["a0", "a3", "a7", "n"]
    assert engine.abort(["a0"]) == []  # already being aborted
    deltas = engine.step()
    out.add(deltas)
    abort_keys = {(d.request_id, d.index) for d in deltas if d.finish_reason is FinishReason.ABORT}
    assert abort_keys == {("a0", 0), ("a3", 0), ("a7", 0), ("n", 0), ("n", 1), ("n", 2)}
    for _ in range(3):
        out.add(engine.step())
    rest = engine.abort([f"a{i}" for i in range(8)])
    assert set(rest) == {"a1", "a2", "a4", "a5", "a6"}
    out.add(engine.step())
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats.num_free_blocks == free_at_start
    assert stats.num_running == stats.num_waiting == 0
    assert all(reason is FinishReason.ABORT for reason in out.finish.values())
    assert engine.step() == []



INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("empty prompt", {"prompt": ()}, "prompt_token_ids"),
    ("negative token", {"prompt": (5, -1)}, "prompt_token_ids"),
    ("token == vocab", {"prompt": (5, 1024)}, "prompt_token_ids"),
    ("huge token", {"prompt": (2**40,)}, "prompt_token_ids"),
    ("non-int token", {"prompt": (5, 1.5)}, "prompt_token_ids"),
    ("prompt fills max_model_len", {"prompt": (5,) * 256}, "prompt_token_ids"),
    ("prompt + max_tokens too long", {"prompt": (5,) * 200, "max_tokens": 57}, "max_tokens"),
    ("min_tokens past max_model_len", {"prompt": (5,) * 200, "min_tokens": 57}, "min_tokens"),
    ("stop id outside vocab", {"stop_token_ids": (5000,)}, "stop_token_ids"),
    ("logit_bias id outside vocab", {"logit_bias": ((-3, 1.0),)}, "logit_bias"),
    ("top_k above vocab", {"top_k": 5000}, "top_k"),
    ("n above max_num_seqs", {"n": 9}, "n"),
    ("empty request id", {"request_id": ""}, "request_id"),
    ("duplicate request id", {"request_id": "busy"}, "request_id"),
]


def test_invalid_requests_are_refused_and_others_keep_running(model_dir: Path, ref_model: Any) -> None:
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=8,
                                    max_waiting=64))
    good_prompt = _prompt(1, 20)
    engine.add_request(EngineRequest("busy", good_prompt, SamplingParams(temperature=0.0, max_tokens=20)))
    out = Collected()
    out.add(engine.step())
    for name, case, field_name in INVALID:
        params = {k: v for k, v in case.items() if k not in ("prompt", "request_id")}
        request = EngineRequest(case.get("request_id", f"bad-{name}"), case.get("prompt", (5, 6, 7)),
                                SamplingParams(**params))
        with pytest.raises(RequestError) as err:
            engine.add_request(request)
        assert err.value.field_name == field_name, name
        out.add(engine.step())
    while engine.has_unfinished():
        out.add(engine.step())
    want = reference_greedy(ref_model, [list(good_prompt)], [20], eos_id=1)[0]
    assert out.tokens[("busy", 0)] == want
    assert set(out.finish) == {("busy", 0)}


@pytest.mark.parametrize(("field_name", "kwargs"), [
    ("temperature", {"temperature": float("nan")}),
    ("top_p", {"top_p": 0.0}),
    ("top_k", {"top_k": -1}),
    ("min_p", {"min_p": 1.5}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("presence_penalty", {"presence_penalty": 3.0}),
    ("frequency_penalty", {"frequency_penalty": float("inf")}),
    ("logit_bias[5]", {"logit_bias": ((5, float("nan")),)}),
    ("max_tokens", {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 2}),
    ("logprobs", {"logprobs": 21}),
    ("n", {"n": 0}),
])
def test_sampling_params_ranges(field_name: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(RequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field_name == field_name


def test_waiting_queue_is_bounded(model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=16, max_waiting=3))
    for i in range(3):
        engine.add_request(EngineRequest(f"w{i}", (5, 6), SamplingParams(max_tokens=2)))
    with pytest.raises(EngineOverloaded):
        engine.add_request(EngineRequest("w3", (5, 6), SamplingParams(max_tokens=2)))
    engine.abort([f"w{i}" for i in range(3)])
    engine.step()
    assert not engine.has_unfinished()


def test_missing_or_incomplete_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
