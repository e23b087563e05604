"""Decides, each step, which sequences compute how many tokens (prefill chunks and decodes mixed).

Policy (vLLM v1 / nano-vllm, with vLLM's priority order): running sequences first, in admission
order, each asking for all its uncomputed tokens within the step's token budget; when KV blocks run
out, the running sequence last in (priority, arrival) order is preempted (blocks freed, recomputed
later). Then waiting sequences are admitted in (priority, arrival) order while budget, sequence
slots and blocks allow, reusing prefix-cached blocks; the first that does not fit holds back the
rest. A waiting sequence never preempts a running one (vLLM v1 neither).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from engine_server.engine.block_manager import BlockManager
from engine_server.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (== num_computed_tokens before the step)
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """Whether this step computes the sequence's last token, so it samples a new one."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()  # NOTE: kept sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # oldest admission first
        self.num_preemptions = 0
        self.num_prefix_cache_hit_tokens = 0

    def add_running(self, seq: Sequence) -> None:
        """A forked n>1 sibling: it already holds the prompt's shared blocks, so it skips the queue."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def add(self, seq: Sequence) -> None:
        """Queues a new or preempted sequence at its (priority, arrival) place."""
        seq.status = SequenceStatus.WAITING
        waiting = self.waiting
        # NOTE: the common cases in O(1): a new arrival of the last priority, a preempted one of the first
        key = seq.sort_key
        if not waiting or waiting[-1].sort_key <= key:
            waiting.append(seq)
        elif key <= waiting[0].sort_key:
            waiting.appendleft(seq)
        else:
            waiting.insert(bisect.bisect_right(waiting, key, key=_sort_key), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drops a sequence wherever it is (finish or abort) and frees its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        # (WAITING_FOR_GRAMMAR: never added; FINISHED: already removed)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # 1) running sequences, oldest admission first; when blocks run out, preempt the last in
        #    (priority, arrival) order, even one already scheduled this step (its work is taken back)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            start = seq.num_computed_tokens
            while not self.block_manager.ensure_blocks(seq, start + num_new):
                victim = self._pick_victim()
                victim_pos = self.running.index(victim)
                del self.running[victim_pos]
                if victim_pos < i:  # scheduled already: unschedule it; seq moved up one
                    budget += _unschedule(out, victim)
                    i -= 1
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, start, num_new))
                budget -= num_new
                i += 1
        # 2) admit waiting sequences (not in a step that had to preempt: memory is short)
        while (out.num_preempted == 0 and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            # NOTE: waiting sequences hold no blocks (preemption frees them all).
            cached, hashes = ([], []) if seq.wants_prompt_logprobs else self.block_manager.match_prefix(seq)
            # (prompt logprobs need every prompt position's logits: no cache reuse for them)
            num_computed = len(cached) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            if not self.block_manager.can_admit(cached, num_computed + num_new):
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, cached, hashes)
            self.num_prefix_cache_hit_tokens += seq.num_computed_tokens
            if seq.is_first_output and seq.num_output_tokens == 0 and seq.index == 0:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            ok = self.block_manager.ensure_blocks(seq, seq.num_computed_tokens + num_new)
            if not ok:  # NOTE: can_admit checked this; kept as a guard against accounting bugs
                raise RuntimeError("block accounting error while admitting a sequence")
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        self.num_preemptions += out.num_preempted
        return out

    def _pick_victim(self) -> Sequence:
        """The running sequence to preempt: the last in (priority, arrival) order (youngest if all equal)."""
        return max(self.running, key=_sort_key)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.add(seq)


def _sort_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key


def _unschedule(out: SchedulerOutput, seq: Sequence) -> int:
    """Takes seq's work out of this step; returns its tokens (back into the budget)."""
    for pos, scheduled in enumerate(out.scheduled):
        if scheduled.seq is seq:
            del out.scheduled[pos]
            return scheduled.num_new_tokens
    raise RuntimeError("a running sequence before the cursor was not scheduled")
