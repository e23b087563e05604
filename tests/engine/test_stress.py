"""A random mix of every knob, aborts and a cache small enough to preempt: invariants must hold."""

from __future__ import annotations

import random
from pathlib import Path

from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, FinishReason, SamplingParams
from engine_testutil import Collected, engine_config


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        n=rng.choice([1, 1, 2, 3]),
        temperature=rng.choice([0.0, 0.7, 1.0, 1.5]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        top_k=rng.choice([0, 0, 5, 50]),
        min_p=rng.choice([0.0, 0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
        presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, -0.5, 1.0]),
        seed=rng.choice([None, rng.randrange(1000)]),
        logit_bias=rng.choice([(), ((5, 3.0), (6, -100.0))]),
        min_tokens=rng.choice([0, 0, 2]),
        max_tokens=rng.randrange(2, 30),
        stop_token_ids=rng.choice([(), (rng.randrange(3, 1000),)]),
        ignore_eos=rng.random() < 0.3,
        logprobs=rng.choice([None, 0, 3]),
        prompt_logprobs=rng.choice([None, None, 2]),
    )


def test_random_workload_with_aborts_keeps_every_invariant(model_dir: Path) -> None:
    rng = random.Random(42)
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=24, max_num_batched_tokens=48,
                                    max_num_seqs=12, max_model_len=384))
    free_at_start = engine.stats().num_free_blocks
    requests: dict[str, EngineRequest] = {}
    for i in range(40):
        prompt = tuple(rng.randrange(3, 1000) for _ in range(rng.randrange(1, 60)))
        if i % 4 == 1:  # shared prefixes for prefix-cache hits
            prompt = next(iter(requests.values())).prompt_token_ids[:20] + prompt
        requests[f"s{i}"] = EngineRequest(f"s{i}", prompt, _random_params(rng))
    out = Collected()
    pending = list(requests.values())
    aborted: set[str] = set()
    for _ in range(5000):
        for request in pending[:2]:
            engine.add_request(request)
        pending = pending[2:]
        if rng.random() < 0.05 and engine.has_unfinished():
            victim = rng.choice(sorted(requests))
            aborted.update(engine.abort([victim]))
        out.add(engine.step())
        if not pending and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats.num_free_blocks == free_at_start
    assert stats.num_preemptions > 0
    for request_id, request in requests.items():
        params = request.params
        for index in range(params.n):
            key = (request_id, index)
            assert key in out.finish, key
            tokens = out.tokens[key]
            assert params.max_tokens is not None
            assert len(tokens) <= params.max_tokens
            if out.finish[key] is FinishReason.ABORT:
                assert request_id in aborted
                continue
            assert all(0 <= t < 1024 for t in tokens)
            if params.logit_bias:
                assert 6 not in tokens  # biased by -100
            if index == 0 and params.prompt_logprobs is not None:
                first = next(d for d in out.deltas if (d.request_id, d.index) == key)
                assert first.prompt_logprobs is not None
                scored = [e.token_id for e in first.prompt_logprobs[1:] if e]
                assert scored == list(request.prompt_token_ids[1:])
            if out.finish[key] is FinishReason.LENGTH:
                assert len(tokens) == params.max_tokens
            if params.logprobs is not None:
                lps = [lp for d in out.deltas if (d.request_id, d.index) == key for lp in (d.logprobs or [])]
                assert [lp.token_id for lp in lps] == tokens
