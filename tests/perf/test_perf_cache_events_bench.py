"""The cache-event benchmarks' machinery (bench/kv_events_cost.py, bench/fleet_cache_bench.py), not their
numbers: the block-manager pass runs with and without recording over the same work, the fleet workload sends
the same growing conversations to every policy, and its report states the targets from the right rows."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fleet_cache_bench
import kv_events_cost


def test_block_manager_pass_records_only_when_asked() -> None:
    for recording in (False, True):
        assert kv_events_cost.block_manager_alone(64, 4, recording=recording, waves=2) > 0
    prompt = kv_events_cost.prompt(1, 3)
    assert len(prompt) == kv_events_cost.SYSTEM_LEN + kv_events_cost.TAIL_LEN
    assert prompt[:kv_events_cost.SYSTEM_LEN] == kv_events_cost.prompt(2, 3)[:kv_events_cost.SYSTEM_LEN]


def _args(**overrides: int) -> argparse.Namespace:
    values = {"system_prompts": 4, "system_words": 20, "turns": 3, "conversations": 8, "concurrency": 2,
              "max_tokens": 4, "kv_blocks": 100}
    values.update(overrides)
    return argparse.Namespace(**values)


def test_conversations_grow_turn_by_turn_and_share_system_prompts() -> None:
    args = _args()
    turns = fleet_cache_bench.conversation_requests(5, args)
    assert len(turns) == 3
    for earlier, later in itertools.pairwise(turns):
        assert later[:len(earlier)] == earlier  # the whole history, then an answer and the next question
    assert turns[0][0] == fleet_cache_bench.conversation_requests(1, args)[0][0]  # 5 % 4 == 1 % 4
    assert turns[0][0] != fleet_cache_bench.conversation_requests(2, args)[0][0]


def test_report_compares_each_fleet_with_round_robin_and_the_single_worker() -> None:
    Result = fleet_cache_bench.Result
    results = [Result(1, "round_robin", 10, 0.5, 50.0, 100.0, 1.0, 10.0),
               Result(2, "round_robin", 10, 0.3, 40.0, 200.0, 2.0, 20.0),
               Result(2, "cache_aware (events)", 10, 0.6, 30.0, 100.0, 3.0, 30.0)]
    text = fleet_cache_bench.markdown(results, _args(), "bench/fleet_cache_bench.py")
    assert text.startswith(fleet_cache_bench.MARK_START)
    assert text.rstrip().endswith(fleet_cache_bench.MARK_END)
    assert "| 2 | cache_aware (events) | 10 | 0.600 | 1.20x |" in text
    assert "TTFT p99 0.50x (target <= 0.6x)" in text
    assert "(1.20x the single worker's; target >= 0.9x)" in text
