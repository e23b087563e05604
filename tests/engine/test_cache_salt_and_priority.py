"""Cache isolation (cache_salt), FlushCache and priority scheduling on a real LLMEngine (issue 40)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, RequestError, SamplingParams
from engine_server.frontend.validation import validate_request
from engine_testutil import Collected, engine_config, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _prompt(seed: int, length: int = 40) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 1000) for _ in range(length))


def _cached(out: Collected, request_id: str) -> int:
    return next(d.num_cached_prompt_tokens for d in out.deltas if d.request_id == request_id and d.index == 0)


def _one(engine: LLMEngine, request_id: str, prompt: tuple[int, ...], salt: str = "") -> Collected:
    return run(engine, [EngineRequest(request_id, prompt, GREEDY, cache_salt=salt)])


# --- cache_salt ---------------------------------------------------------------------------------------

def test_different_salts_never_share_cached_blocks_and_equal_salts_do(engine: LLMEngine) -> None:
    prompt = _prompt(4001)  # 40 tokens: two full blocks of 16 can be reused
    first = _one(engine, "salt-a1", prompt, "tenant-a")
    assert _cached(first, "salt-a1") == 0
    assert _cached(_one(engine, "salt-b1", prompt, "tenant-b"), "salt-b1") == 0
    assert _cached(_one(engine, "salt-none", prompt), "salt-none") == 0
    again = _one(engine, "salt-a2", prompt, "tenant-a")
    assert _cached(again, "salt-a2") == 32
    assert _cached(_one(engine, "salt-b2", prompt, "tenant-b"), "salt-b2") == 32
    assert again.tokens[("salt-a2", 0)] == first.tokens[("salt-a1", 0)]  # a hit changes no token


def test_a_cache_salt_over_the_bound_is_refused(engine: LLMEngine) -> None:
    with pytest.raises(RequestError, match="cache_salt"):  # at admission, in the frontend
        validate_request(EngineRequest("long-salt", _prompt(4002), GREEDY, cache_salt="x" * 257),
                         engine.model_info)


# --- FlushCache ---------------------------------------------------------------------------------------

def test_flush_drops_cached_prefixes(engine: LLMEngine) -> None:
    prompt = _prompt(4003)
    first = _one(engine, "flush-1", prompt)
    assert engine.flush_cache() >= 2
    again = _one(engine, "flush-2", prompt)
    assert _cached(again, "flush-2") == 0
    assert again.tokens[("flush-2", 0)] == first.tokens[("flush-1", 0)]
    assert _cached(_one(engine, "flush-3", prompt), "flush-3") == 32  # the cache fills again


def test_flush_with_a_request_running_changes_its_tokens_not_and_its_blocks_are_not_reused(
    engine: LLMEngine,
) -> None:
    prompt = _prompt(4004)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    reference = run(engine, [EngineRequest("flush-ref", prompt, params, cache_salt="flush-ref")])
    out = Collected()
    engine.add_request(EngineRequest("flush-running", prompt, params, cache_salt="flush-run"))
    for _ in range(3):  # the prompt is computed and cached, a few tokens decoded
        out.add(engine.step())
    assert engine.flush_cache() >= 2
    while engine.has_unfinished():
        out.add(engine.step())
    assert out.tokens[("flush-running", 0)] == reference.tokens[("flush-ref", 0)]
    later = _one(engine, "flush-later", prompt, "flush-run")
    assert _cached(later, "flush-later") == 0


# --- priority -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_engine(model_dir: Path) -> LLMEngine:
    """A KV cache of 12 blocks of 16 tokens: four 40-token requests fill it (3 blocks each)."""
    return LLMEngine(engine_config(model_dir, num_kv_blocks=12, max_num_batched_tokens=256,
                                   enable_prefix_caching=False))


def _first_token_steps(engine: LLMEngine, low: list[EngineRequest], high: list[EngineRequest], *,
                       high_after: int) -> tuple[dict[str, int], Collected]:
    """Adds `low` at once, `high` after `high_after` steps; the step of each request's first token."""
    out = Collected()
    first: dict[str, int] = {}
    for request in low:
        engine.add_request(request)
    step = 0
    while engine.has_unfinished() or step <= high_after:
        if step == high_after:
            for request in high:
                engine.add_request(request)
        deltas = engine.step()
        out.add(deltas)
        step += 1
        for delta in deltas:
            if delta.new_token_ids:
                first.setdefault(delta.request_id, step)
        assert step < 2_000, "the engine did not finish"
    return first, out


def _requests(prefix: str, count: int, *, priority: int, seed: int) -> list[EngineRequest]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [EngineRequest(f"{prefix}{i}", _prompt(seed + i, 24), params, priority=priority)
            for i in range(count)]


def test_high_priority_ttft_stays_bounded_behind_a_long_low_priority_queue(small_engine: LLMEngine) -> None:
    # 24 low-priority requests of 2 blocks (24 prompt + 8 output tokens) each; only 6 fit at once.
    low = _requests("low", 24, priority=10, seed=5000)
    high = _requests("high", 2, priority=-1, seed=6000)
    first, out = _first_token_steps(small_engine, low, high, high_after=2)
    fcfs_first, fcfs_out = _first_token_steps(
        small_engine, _requests("low", 24, priority=0, seed=5000),
        _requests("high", 2, priority=0, seed=6000), high_after=2)
    # With priority, a high request waits only for room (a running request's 8 tokens), not for the queue.
    for request_id in ("high0", "high1"):
        assert first[request_id] - 2 <= 10, first
        assert fcfs_first[request_id] - 2 > 20, fcfs_first  # FCFS: behind the 24 low ones
    # FCFS within one priority: the low ones start in arrival order.
    low_starts = [first[f"low{i}"] for i in range(24)]
    assert low_starts == sorted(low_starts)
    # Priority changes when, not what: greedy tokens are the same in both runs.
    assert out.tokens == fcfs_out.tokens
    assert small_engine.stats().num_free_blocks == 12


def test_preemption_under_a_full_cache_takes_the_lowest_priority_first(small_engine: LLMEngine) -> None:
    # Five requests that each grow to 3 blocks (24 prompt + 24 output tokens); 12 blocks hold them only
    # while they are short: when the cache runs out, the priority-5 one is preempted, not the youngest.
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = [EngineRequest(f"grow{i}", _prompt(7000 + i, 24), params, priority=p)
                for i, p in enumerate((0, 5, 0, 0, 0))]
    num_preemptions = small_engine.stats().num_preemptions
    out = Collected()
    for request in requests:
        small_engine.add_request(request)
    finished_at: dict[str, int] = {}
    step = 0
    while small_engine.has_unfinished():
        out.add(small_engine.step())
        step += 1
        for key in out.finish:
            finished_at.setdefault(key[0], step)
    assert small_engine.stats().num_preemptions == num_preemptions + 1
    assert finished_at["grow1"] == max(finished_at.values())  # the low-priority one was set back
    alone = run(small_engine, [EngineRequest("alone", _prompt(7001, 24), params)])
    assert out.tokens[("grow1", 0)] == alone.tokens[("alone", 0)]  # recomputed, same tokens
