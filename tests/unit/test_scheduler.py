"""Scheduler: token budget (chunked prefill), admission and preemption by (priority, arrival)."""

from __future__ import annotations

from engine_server.engine.block_manager import BlockManager
from engine_server.engine.scheduler import Scheduler, SchedulerOutput
from engine_server.engine.sequence import Sequence, SequenceStatus
from engine_server.engine.types import SamplingParams


def _seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, params=SamplingParams(),
                    token_ids=[seq_id + 3] * num_tokens, num_prompt_tokens=num_tokens, max_tokens=64)


def _finish_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after the forward: count computed tokens, append a token if complete."""
    for s in out.scheduled:
        complete = s.completes
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.block_manager.register_full_blocks(s.seq)
        if complete:
            s.seq.token_ids.append(7)


def test_long_prompt_is_prefilled_in_chunks_alongside_decodes() -> None:
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=8,
                      max_num_batched_tokens=10)
    short = _seq(0, 3)
    long = _seq(1, 25)
    sched.add(short)
    sched.add(long)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 3), (1, 7)]
    _finish_step(sched, out)
    out = sched.schedule()  # decode of the short one + the next chunk of the long one
    assert [(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled] == [(0, 3, 1), (1, 7, 9)]
    assert out.num_batched_tokens == 10
    assert not out.scheduled[1].completes


def test_admission_respects_max_num_seqs_and_fifo() -> None:
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=2,
                      max_num_batched_tokens=100)
    seqs = [_seq(i, 4) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2, 3]


def test_youngest_running_sequence_is_preempted_and_requeued_first() -> None:
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, young = _seq(0, 8), _seq(1, 8)  # two blocks each: the cache is full
    sched.add(old)
    sched.add(young)
    _finish_step(sched, sched.schedule())  # both now have 9 tokens: each needs a third block
    out = sched.schedule()
    assert out.num_preempted == 1
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert young.status is SequenceStatus.WAITING
    assert young.block_table == []
    assert young.num_computed_tokens == 0
    assert sched.waiting[0] is young
    assert sched.num_preemptions == 1
    assert bm.num_free_blocks == 1
    # When the old one finishes, the young one is recomputed: prompt and generated token alike.
    sched.remove(old)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled] == [(1, 0, 9)]


def test_prefix_cache_hits_are_counted_on_admission() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = _seq(0, 9)
    sched.add(a)
    _finish_step(sched, sched.schedule())
    b = _seq(1, 9)
    b.token_ids = [*list(a.token_ids[:8]), 5]
    sched.add(b)
    out = sched.schedule()
    scheduled_b = next(s for s in out.scheduled if s.seq is b)
    assert scheduled_b.start == 8
    assert scheduled_b.num_new_tokens == 1
    assert sched.num_prefix_cache_hit_tokens == 8


def _prio(seq_id: int, num_tokens: int, priority: int) -> Sequence:
    seq = _seq(seq_id, num_tokens)
    seq.priority = priority
    seq.arrival = seq_id
    return seq


def test_waiting_sequences_are_admitted_by_priority_then_arrival() -> None:
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=8,
                      max_num_batched_tokens=100)
    for seq_id, priority in [(0, 5), (1, 0), (2, 5), (3, -1), (4, 0), (5, 5)]:
        sched.add(_prio(seq_id, 4, priority))
    assert [s.seq_id for s in sched.waiting] == [3, 1, 4, 0, 2, 5]
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [3, 1, 4, 0, 2, 5]


def test_a_waiting_request_that_does_not_fit_holds_back_lower_priorities() -> None:
    sched = Scheduler(BlockManager(4, 4, enable_prefix_caching=False), max_num_seqs=8,
                      max_num_batched_tokens=100)
    sched.add(_prio(0, 8, 1))
    _finish_step(sched, sched.schedule())  # 3 of 4 blocks in use
    sched.add(_prio(1, 8, 0))  # needs 2 blocks: waits
    sched.add(_prio(2, 2, 2))  # would fit, but comes after it
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert [s.seq_id for s in sched.waiting] == [1, 2]


def test_the_lowest_priority_running_sequence_is_preempted_first() -> None:
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    low, high, mid = _prio(0, 8, 9), _prio(1, 8, 0), _prio(2, 8, 5)
    for seq in (low, high, mid):
        sched.add(seq)
    _finish_step(sched, sched.schedule())  # 9 tokens each: each needs a third block, none is free
    assert [s.seq_id for s in sched.running] == [1, 2, 0]  # admitted by priority
    out = sched.schedule()
    # The lowest priority goes first although it was admitted last... then the next lowest.
    assert [s.seq.seq_id for s in out.scheduled] == [1, 2]
    assert [s.seq_id for s in sched.waiting] == [0]
    assert out.num_preempted == 1


def test_a_preempted_sequence_already_scheduled_this_step_is_taken_back() -> None:
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    low = _prio(0, 4, 9)
    sched.add(low)
    _finish_step(sched, sched.schedule())  # low: 5 tokens, 2 blocks
    high = _prio(1, 4, 0)
    sched.add(high)
    _finish_step(sched, sched.schedule())  # high admitted after low: running [low, high], 3 blocks used
    low.token_ids.extend([7] * 3)  # low grows to a third block in this step, scheduled first
    high.token_ids.extend([7] * 3)
    out = sched.schedule()
    # low was scheduled (it got its third block), then high ran out: low is the victim and its work is
    # taken back, so high runs alone and the budget holds only high's tokens.
    assert [s.seq.seq_id for s in out.scheduled] == [1]
    assert out.num_batched_tokens == out.scheduled[0].num_new_tokens
    assert low.status is SequenceStatus.WAITING
    assert low.block_table == []
    assert bm.num_free_blocks == 4 - len(high.block_table)


def test_equal_priorities_keep_first_come_first_served_and_preempt_the_youngest() -> None:
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, young = _prio(0, 8, 3), _prio(1, 8, 3)
    sched.add(old)
    sched.add(young)
    _finish_step(sched, sched.schedule())
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert sched.waiting[0] is young
    newer = _prio(2, 4, 3)
    sched.add(newer)
    assert [s.seq_id for s in sched.waiting] == [1, 2]  # the preempted one keeps its place by arrival
