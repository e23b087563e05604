"""Token masks of constrained rows: filled by llguidance beside the forward pass, applied to logits after it.

NOTE: llguidance's executor fills the masks of many matchers in parallel (its own threads) and drops the GIL
meanwhile, so `start` hands that call to one Python thread and returns; the step's forward pass runs
meanwhile, and `finish` joins (within a deadline) before anything touches a matcher again.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from engine_server.engine import cpu_kernels
from engine_server.engine.sequence import Sequence

if TYPE_CHECKING:
    from llguidance import LLMatcher

logger = logging.getLogger(__name__)


class AllowedTokens:
    """What some rows of a step's logits may sample: row rows[j] the tokens whose bit is set in bitmask[j]."""

    __slots__ = ("bitmask", "rows")

    def __init__(self, rows: list[int], bitmask: np.ndarray) -> None:
        self.rows = rows
        self.bitmask = bitmask  # int32 [len(rows), ceil(vocab / 32)]

    def apply(self, logits: torch.Tensor) -> None:
        """In place: -inf for every token a row's constraint forbids."""
        rows = torch.tensor(self.rows, dtype=torch.long)
        bitmask = torch.from_numpy(self.bitmask)
        on_cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
        kernels = cpu_kernels.load() if on_cpu else None
        if kernels is not None:
            kernels.apply_token_bitmask(logits, rows, bitmask)
            return
        # NOTE: the torch path (CUDA, or no compiled kernels): unpack the bits, then one masked copy
        rows = rows.to(logits.device)
        words = bitmask.to(logits.device)
        bits = torch.tensor([1 << k for k in range(31)] + [-(1 << 31)], dtype=torch.int32,
                            device=logits.device)
        allowed = ((words[:, :, None] & bits) != 0).reshape(words.shape[0], -1)[:, :logits.shape[1]]
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))

    def only_stops_allowed(self, j: int, stop_ids: list[int]) -> bool:
        """Whether row rows[j] may sample nothing but these (stop) tokens."""
        others = self.bitmask[j].view(np.uint32).copy()
        for token in stop_ids:
            others[token >> 5] &= ~np.uint32(1 << (token & 31))
        return not others.any()


class MaskFill:
    """One step's masks being filled: row row_of[seq_id] of `bitmask` for that sequence (seqs[row])."""

    __slots__ = ("bitmask", "future", "matchers", "row_of", "seqs")

    def __init__(self, bitmask: np.ndarray, seqs: list[Sequence], matchers: list[tuple[LLMatcher, int]],
                 future: Future[None]) -> None:
        self.bitmask = bitmask  # int32 [rows, ceil(vocab / 32)], bit t of a row = token t allowed
        self.seqs = seqs
        self.row_of = {seq.seq_id: i for i, seq in enumerate(seqs)}
        self.matchers = matchers
        self.future = future

    def allowed(self, sample_rows: list[int], keys: list[int]) -> AllowedTokens:
        """The masks of these sampling rows (keys[j]: the sequence whose mask rows[j] takes)."""
        mask_rows = [self.row_of[k] for k in keys]
        if mask_rows == list(range(self.bitmask.shape[0])):  # the common case: no fork, every row samples
            return AllowedTokens(sample_rows, self.bitmask)
        return AllowedTokens(sample_rows, self.bitmask[mask_rows])


class MaskFiller:
    """Fills the masks of a step's constrained rows on a thread of its own, within a deadline.

    NOTE: llguidance can loop for ever on some grammars (1.9.1: a terminal /a+/ followed by the literal "a").
    A fill past `timeout_s` is abandoned with its threads (they spin on, out of reach); its rows are filled
    again one by one on fresh threads, and a row whose matcher is still held by the stuck call, or that sticks
    again, keeps an empty mask: a dead end for that completion, not a stalled engine.
    """

    def __init__(self, vocab_size: int, *, timeout_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self._words = (vocab_size + 31) // 32
        self._executor, self._thread = self._new_threads()
        # NOTE: a stuck call still holds a pointer into its step's bitmask: kept alive (never reused) so that
        # whatever it writes lands in memory nobody reads
        self._abandoned: list[np.ndarray] = []

    def start(self, seqs: list[Sequence]) -> MaskFill:
        """Starts filling the masks of these constrained sequences (each has a matcher)."""
        bitmask = np.zeros((len(seqs), self._words), dtype=np.int32)
        matchers = [(seq.matcher, i) for i, seq in enumerate(seqs) if seq.matcher is not None]
        future = self._thread.submit(self._executor.unsafe_compute_mask_ptr, matchers, bitmask.ctypes.data,
                                     self._words * 4, len(seqs))
        return MaskFill(bitmask, seqs, matchers, future)

    def finish(self, fill: MaskFill) -> set[int]:
        """Waits for the fill (at most `timeout_s`); the rows whose mask could not be had (left empty)."""
        try:
            fill.future.result(timeout=self.timeout_s)
            return set()
        except TimeoutError:
            pass
        logger.error("a step's token masks took longer than %g s (a grammar llguidance cannot mask); "
                     "refilling its %d rows one by one", self.timeout_s, len(fill.matchers))
        self._abandoned.append(fill.bitmask)
        self._executor, self._thread = self._new_threads()
        fill.bitmask = np.zeros_like(fill.bitmask)
        stuck: set[int] = set()
        for matcher, row in fill.matchers:
            out = fill.bitmask[row]
            try:
                self._thread.submit(matcher.unsafe_compute_mask_ptr, out.ctypes.data,
                                    out.nbytes).result(timeout=self.timeout_s)
            except TimeoutError:  # stuck again: this row is one that llguidance loops on
                self._abandoned.append(fill.bitmask)
                self._executor, self._thread = self._new_threads()
                fill.bitmask[row] = 0
                stuck.add(row)
            except RuntimeError:  # "Already mutably borrowed": the stuck call holds this matcher
                stuck.add(row)
        return stuck

    def _new_threads(self) -> tuple[llguidance.LLExecutor, ThreadPoolExecutor]:
        # NOTE: llguidance's executor: 80% of the cores (up to 32), at least one thread
        return llguidance.LLExecutor(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
