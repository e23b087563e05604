"""Greedy decoding through the paged, continuously batched engine equals transformers' generate."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, FinishReason, SamplingParams
from engine_testutil import engine_config, reference_greedy, run


def _workload(seed: int, num_requests: int) -> tuple[list[list[int]], list[int]]:
    """Mixed prompt/output lengths; a third of the prompts share one of two long prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(2)]
    lengths = [1, 5, 16, 17, 33, 70]  # few distinct lengths: the reference batches equal lengths
    prompts, max_tokens = [], []
    for i in range(num_requests):
        length = lengths[i % len(lengths)]
        prompt = [rng.randrange(3, 1000) for _ in range(length)]
        if i % 3 == 0 and length >= 33:
            prompt = prefixes[i % 2][:length - 8] + prompt[:8]
        prompts.append(prompt)
        max_tokens.append(rng.choice([1, 3, 8, 20, 40]))
    return prompts, max_tokens


def test_greedy_matches_generate_staggered_with_preemption_and_prefix_hits(
        model_dir: Path, ref_model: Any) -> None:
    prompts, max_tokens = _workload(0, 64)
    # Small cache (preemption), small token budget (chunked prefill), staggered arrivals.
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=40, max_num_batched_tokens=64,
                                    max_num_seqs=32))
    free_at_start = engine.stats().num_free_blocks
    requests = [EngineRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0, max_tokens=m))
                for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
    got = run(engine, requests, per_step=3)
    want = reference_greedy(ref_model, prompts, max_tokens, eos_id=1)
    for i, expected in enumerate(want):
        assert got.tokens[(f"r{i}", 0)] == expected, f"request r{i}"
        stopped = expected[-1] == 1  # EOS
        assert got.finish[(f"r{i}", 0)] is (FinishReason.STOP if stopped else FinishReason.LENGTH)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_prefix_cache_hit_tokens > 0
    assert stats.num_free_blocks == free_at_start
    assert stats.num_running == stats.num_waiting == 0
