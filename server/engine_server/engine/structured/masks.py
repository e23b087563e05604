"""Token masks of constrained rows: filled by llguidance beside the forward pass, applied to logits after it.

NOTE: llguidance's executor fills the masks of many matchers in parallel (Rust threads) and drops the GIL,
so `start` hands that work to one Python thread and returns at once; the step's forward pass runs meanwhile
and `result` joins before sampling.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from engine_server.engine.sequence import Sequence


class MaskFill:
    """One step's masks being filled: row i of `bitmask` for matchers[i]."""

    __slots__ = ("_future", "bitmask", "row_of")

    def __init__(self, bitmask: np.ndarray, row_of: dict[int, int], future: Future[None] | None) -> None:
        self.bitmask = bitmask  # int32 [rows, ceil(vocab / 32)], bit t of a row = token t allowed
        self.row_of = row_of  # seq_id -> row of bitmask
        self._future = future

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()


class MaskFiller:
    def __init__(self, vocab_size: int, *, num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        # bit k of a 32-bit word, for unpacking masks into booleans
        self._bits = torch.tensor([1 << k for k in range(31)] + [-(1 << 31)], dtype=torch.int32)

    def start(self, seqs: list[Sequence]) -> MaskFill:
        """Starts filling the masks of these constrained sequences (each must have a matcher)."""
        bitmask = np.zeros((len(seqs), self._words), dtype=np.int32)
        row_of = {seq.seq_id: i for i, seq in enumerate(seqs)}
        if not seqs:
            return MaskFill(bitmask, row_of, None)
        matchers = [(seq.matcher, i) for i, seq in enumerate(seqs) if seq.matcher is not None]
        future = self._thread.submit(self._executor.unsafe_compute_mask_ptr, matchers, bitmask.ctypes.data,
                                     self._words * 4, len(seqs))
        return MaskFill(bitmask, row_of, future)

    def allowed(self, bitmask: np.ndarray) -> torch.Tensor:
        """int32 bitmask rows -> bool [rows, vocab_size]."""
        words = torch.from_numpy(bitmask)
        return ((words[:, :, None] & self._bits) != 0).reshape(words.shape[0], -1)[:, :self.vocab_size]

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
