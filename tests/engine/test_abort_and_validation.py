"""Abort frees everything; invalid requests are refused at admission with the field named (the frontend's
validation, against the engine's model), a request id in use by the engine itself; others keep going."""

from __future__ import annotations

import dataclasses
import random
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import (
    EngineOverloaded,
    EngineRequest,
    FinishReason,
    RequestError,
    SamplingParams,
)
from engine_server.frontend.validation import validate_request
from engine_testutil import Collected, engine_config, reference_greedy


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 1000) for _ in range(length))


def test_abort_running_waiting_and_prefilling_requests_frees_every_block(model_dir: Path) -> None:
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=64, max_num_batched_tokens=32,
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


def test_aborting_one_completion_frees_only_its_own_blocks(model_dir: Path) -> None:
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=64, max_num_batched_tokens=64))
    block_manager = engine.block_manager
    free_at_start = block_manager.num_free_blocks
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)
    engine.add_request(EngineRequest("n3", _prompt(5, 40), params))  # 2 full prompt blocks, shared
    out = Collected()
    while len(out.tokens[("n3", 1)]) < 12:  # 52 tokens: 2 shared blocks and 2 of its own
        out.add(engine.step())
    seqs = {seq.index: seq for seq in engine.scheduler.running}
    assert sorted(seqs) == [0, 1, 2]
    table = list(seqs[1].block_table)
    shared = [block for block in table if block_manager.ref_counts[block] > 1]
    own = [block for block in table if block_manager.ref_counts[block] == 1]
    assert (len(shared), len(own)) == (2, 2)
    sizes = {index: len(seqs[index].block_table) for index in (0, 2)}
    free_before = block_manager.num_free_blocks
    assert engine.abort_completions([("n3", 1), ("n3", 3), ("missing", 0)]) == [("n3", 1)]
    assert engine.abort_completions([("n3", 1)]) == []  # already being aborted
    deltas = engine.step()
    out.add(deltas)
    assert {(d.index, d.finish_reason) for d in deltas} == {(0, None), (1, FinishReason.ABORT), (2, None)}
    grown = sum(len(seqs[index].block_table) - sizes[index] for index in (0, 2))
    assert block_manager.num_free_blocks == free_before + len(own) - grown
    assert all(block in block_manager.free_block_ids for block in own)
    assert all(block_manager.ref_counts[block] == 2 for block in shared)  # still held by 0 and 2
    assert [seq.index for seq in engine.scheduler.running] == [0, 2]
    while engine.has_unfinished():
        out.add(engine.step())
    assert out.finish == {("n3", 0): FinishReason.LENGTH, ("n3", 1): FinishReason.ABORT,
                          ("n3", 2): FinishReason.LENGTH}
    assert [len(out.tokens[("n3", i)]) for i in range(3)] == [30, 12, 30]
    assert block_manager.num_free_blocks == free_at_start
    assert engine.abort_completions([("n3", 0)]) == []  # finished: nothing to abort


def test_completions_aborted_before_the_fork(model_dir: Path, ref_model: Any) -> None:
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=64, max_num_batched_tokens=16))
    free_at_start = engine.stats().num_free_blocks
    prompt = _prompt(8, 40)  # three chunks at 16 tokens a step
    engine.add_request(EngineRequest("two", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=12)))
    engine.add_request(EngineRequest("all", _prompt(9, 10), SamplingParams(n=2, max_tokens=12)))
    # Index 0 of "two" computes the prompt for index 1 (still wanted), so it ends only after the fork;
    # index 2 does not exist yet. Every completion of "all" goes, index 0 with nothing left to fork.
    aborted = engine.abort_completions([("two", 0), ("two", 2), ("all", 0), ("all", 1)])
    assert aborted == [("two", 0), ("two", 2), ("all", 0), ("all", 1)]
    out = Collected()
    out.add(engine.step())
    assert set(out.finish) == {("two", 2), ("all", 0), ("all", 1)}
    assert engine.stats().num_running == 1  # "two" index 0, prefilling
    while engine.has_unfinished():
        out.add(engine.step())
    assert out.finish[("two", 0)] is FinishReason.ABORT
    assert out.tokens[("two", 0)] == out.tokens[("two", 2)] == []
    want = reference_greedy(ref_model, [list(prompt)], [12], eos_id=1)[0]
    assert out.tokens[("two", 1)] == want
    assert engine.stats().num_free_blocks == free_at_start


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
    engine = LLMEngine(engine_config(model_dir, max_model_len=256, num_kv_blocks=64, max_num_seqs=8,
                                    max_waiting=64))
    good_prompt = _prompt(1, 20)
    engine.add_request(EngineRequest("busy", good_prompt, SamplingParams(temperature=0.0, max_tokens=20)))
    out = Collected()
    out.add(engine.step())
    for name, case, field_name in INVALID:
        params = {k: v for k, v in case.items() if k not in ("prompt", "request_id")}
        request = EngineRequest(case.get("request_id", f"bad-{name}"), case.get("prompt", (5, 6, 7)),
                                SamplingParams(**params))
        if name == "duplicate request id":  # the engine's own state: only it knows
            admit = engine.add_request
        else:
            admit = partial(validate_request, info=engine.model_info, max_num_seqs=engine.config.max_num_seqs)
        with pytest.raises(RequestError) as err:
            admit(request)
        assert err.value.field_name == field_name, name
        out.add(engine.step())
    while engine.has_unfinished():
        out.add(engine.step())
    want = reference_greedy(ref_model, [list(good_prompt)], [20], eos_id=1)[0]
    assert out.tokens[("busy", 0)] == want
    assert set(out.finish) == {("busy", 0)}


@pytest.mark.parametrize(("name", "request_fields"), [
    ("token == vocab", {"prompt_token_ids": (5, 1024)}),
    ("negative token", {"prompt_token_ids": (5, -1)}),
    ("prompt fills max_model_len", {"prompt_token_ids": (5,) * 256}),
    ("stop id outside vocab", {"params": SamplingParams(stop_token_ids=(5000,))}),
    ("logit_bias id outside vocab", {"params": SamplingParams(logit_bias=((1024, 1.0),))}),
])
def test_the_engine_still_refuses_what_would_index_out_of_bounds(model_dir: Path, name: str,
                                                                 request_fields: dict[str, Any]) -> None:
    # NOTE: asserts (the frontend refuses these first); nothing of the request stays in the engine
    engine = LLMEngine(engine_config(model_dir, max_model_len=256, num_kv_blocks=64))
    request = dataclasses.replace(EngineRequest("unsafe", (5, 6, 7), SamplingParams()), **request_fields)
    with pytest.raises(AssertionError):
        engine.add_request(request)
    assert not engine.has_unfinished(), name


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
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=16, max_waiting=3))
    for i in range(3):
        engine.add_request(EngineRequest(f"w{i}", (5, 6), SamplingParams(max_tokens=2)))
    with pytest.raises(EngineOverloaded):
        engine.add_request(EngineRequest("w3", (5, 6), SamplingParams(max_tokens=2)))
    engine.abort([f"w{i}" for i in range(3)])
    engine.step()
    assert not engine.has_unfinished()


def test_missing_or_incomplete_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(engine_config(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLMEngine(engine_config(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights"):
        LLMEngine(engine_config(tmp_path))


def test_stats_count_requests_and_their_completions_apart(model_dir: Path) -> None:
    # GetLoad's numbers: a request with n = 4 is one running request with four running completions.
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=64))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request(EngineRequest("n4", _prompt(1, 8), dataclasses.replace(params, n=4)))
    engine.add_request(EngineRequest("one", _prompt(2, 8), params))
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_running_completions) == (0, 2, 0)
    engine.step()  # both prefill; "n4" forks its three other completions at its first token
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_running_completions) == (2, 0, 5)
    engine.abort(["n4"])
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_running_completions) == (1, 0, 1)
