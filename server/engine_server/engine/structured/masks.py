"""Token masks of constrained rows: filled by llguidance beside the forward pass, applied to logits after it.

NOTE: llguidance's executor fills the masks of many matchers in parallel (its own threads) and drops the GIL
meanwhile, so `start` hands that call to one Python thread and returns; the step's forward pass runs
meanwhile, and `wait` joins before anything touches a matcher again.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from engine_server.engine import cpu_kernels
from engine_server.engine.sequence import Sequence


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
    """One step's masks being filled: row row_of[seq_id] of `bitmask` for that sequence."""

    __slots__ = ("_future", "bitmask", "row_of")

    def __init__(self, bitmask: np.ndarray, row_of: dict[int, int], future: Future[None]) -> None:
        self.bitmask = bitmask  # int32 [rows, ceil(vocab / 32)], bit t of a row = token t allowed
        self.row_of = row_of
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def allowed(self, sample_rows: list[int], keys: list[int]) -> AllowedTokens:
        """The masks of these sampling rows (keys[j]: the sequence whose mask rows[j] takes)."""
        mask_rows = [self.row_of[k] for k in keys]
        if mask_rows == list(range(self.bitmask.shape[0])):  # the common case: no fork, every row samples
            return AllowedTokens(sample_rows, self.bitmask)
        return AllowedTokens(sample_rows, self.bitmask[mask_rows])


class MaskFiller:
    def __init__(self, vocab_size: int) -> None:
        self._words = (vocab_size + 31) // 32
        # NOTE: llguidance's default: 80% of the cores (up to 32), at least one
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def start(self, seqs: list[Sequence]) -> MaskFill:
        """Starts filling the masks of these constrained sequences (each has a matcher)."""
        bitmask = np.zeros((len(seqs), self._words), dtype=np.int32)
        matchers = [(seq.matcher, i) for i, seq in enumerate(seqs) if seq.matcher is not None]
        future = self._thread.submit(self._executor.unsafe_compute_mask_ptr, matchers, bitmask.ctypes.data,
                                     self._words * 4, len(seqs))
        return MaskFill(bitmask, {seq.seq_id: i for i, seq in enumerate(seqs)}, future)


    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
