"""CUDA graphs of the decode step's forward pass: one graph per batch-size bucket, replayed each decode step.

Why: on a GPU a decode step of a 1B model launched ~570 kernels from Python; the H200 ran them in ~4.4 ms of a
13-21 ms step (BENCHMARKS.md, "Frontend throughput on a GPU"). A graph replays the whole forward pass as one
launch. What makes the pass capturable: every input lives in a static buffer (token ids, positions, cache
slots, block tables, context lengths), padded to the bucket with rows that read and write only a spare cache
block no sequence is given; decode attention is one kernel whose launch depends only on the batch
(engine/triton_decode.py); transformers builds no mask for the engine's attention.

A step takes the graphs only when every scheduled sequence decodes exactly one token that it then samples
(no prompt logprobs, no prefill chunk) and the batch fits the largest bucket; everything else runs eagerly.
`DecodeGraphs(capture=False)` runs the same padded static-buffer pass eagerly on any device: the tests check
the buffers and padding that way on CPU. On CUDA, `capture()` records the graphs and keeps them only if a
replay reproduces the eager pass; any failure leaves the engine eager (as ENGINE_CUDA_GRAPHS=0 does).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine_server.engine.attention import DecodeBatch, PagedMetadata

if TYPE_CHECKING:
    from engine_server.engine.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

DISABLE_ENV = "ENGINE_CUDA_GRAPHS"  # =0: decode steps run eagerly
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


class DecodeGraphs:
    """Static decode-step buffers for up to `max_batch` sequences; a CUDA graph per bucket once captured."""

    def __init__(self, model: torch.nn.Module, *, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 kernel: Callable[..., None], max_batch: int, max_blocks: int, block_size: int,
                 spare_block: int, device: torch.device) -> None:
        self._model = model
        self._kv_caches = kv_caches
        self._kernel = kernel
        self.buckets = (*(b for b in BUCKETS if b < max_batch), max_batch)
        self.max_batch = max_batch
        self._block_size = block_size
        self._spare_block = spare_block
        long = torch.long
        self._ids = torch.zeros((1, max_batch), dtype=long, device=device)
        self._positions = torch.zeros((1, max_batch), dtype=long, device=device)
        self._slots = torch.full((max_batch,), spare_block * block_size, dtype=long, device=device)
        self._tables = torch.full((max_batch, max_blocks), spare_block, dtype=long, device=device)
        self._lens = torch.ones(max_batch, dtype=long, device=device)
        self._keep = torch.arange(max_batch, dtype=long, device=device)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (CUDAGraph, its logits output)

    @property
    def is_captured(self) -> bool:
        return bool(self._graphs)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether the step is all plain decodes (one token each, then sampled) within the largest bucket."""
        return (0 < len(scheduled) <= self.max_batch
                and all(s.num_new_tokens == 1 and s.completes and not s.seq.wants_prompt_logprobs
                        for s in scheduled))

    @torch.inference_mode()
    def run(self, decodes: list[ScheduledSeq]) -> torch.Tensor:
        """Logits [len(decodes), vocab] of the decode step, row i for decodes[i] (`fits` must hold)."""
        n = len(decodes)
        bucket = self.bucket(n)
        assert bucket is not None
        self._fill(decodes, bucket)
        graph = self._graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)[:n]
        graph[0].replay()
        return graph[1][:n]

    def _fill(self, decodes: list[ScheduledSeq], bucket: int) -> None:
        """The step's rows into the static buffers, padding rows up to the bucket (one host-to-device copy per
        buffer, from one CPU tensor each)."""
        size = self._block_size
        spare_slot = self._spare_block * size
        ids = [0] * bucket
        positions = [0] * bucket
        slots = [spare_slot] * bucket
        lens = [1] * bucket
        width = self._tables.shape[1]
        tables = torch.full((bucket, width), self._spare_block, dtype=torch.long)
        for i, s in enumerate(decodes):
            seq, position = s.seq, s.start
            ids[i] = seq.token_ids[position]
            positions[i] = position
            slots[i] = seq.block_table[position // size] * size + position % size
            lens[i] = position + 1
            num_blocks = -(-(position + 1) // size)
            tables[i, :num_blocks] = torch.tensor(seq.block_table[:num_blocks], dtype=torch.long)
        # NOTE: rows past the bucket keep their padding from before (the bucket's graph never reads them)
        self._ids[0, :bucket].copy_(torch.tensor(ids), non_blocking=True)
        self._positions[0, :bucket].copy_(torch.tensor(positions), non_blocking=True)
        self._slots[:bucket].copy_(torch.tensor(slots), non_blocking=True)
        self._lens[:bucket].copy_(torch.tensor(lens), non_blocking=True)
        self._tables[:bucket].copy_(tables, non_blocking=True)

    def _forward(self, bucket: int) -> torch.Tensor:
        """The decode pass over the first `bucket` rows of the static buffers (what a graph records)."""
        meta = PagedMetadata(
            kv_caches=self._kv_caches, slot_mapping=self._slots[:bucket],
            decode_batch=DecodeBatch(q_start=0, q_end=bucket, block_tables=self._tables[:bucket],
                                     context_lens=self._lens[:bucket], kernel=self._kernel),
        )
        out = self._model(input_ids=self._ids[:, :bucket], position_ids=self._positions[:, :bucket],
                          use_cache=False, logits_to_keep=self._keep[:bucket], paged_metadata=meta)
        logits: torch.Tensor = out.logits[0]
        return logits

    def _pad_all(self) -> None:
        """Every row reads and writes the spare block only (capture and self-check run on these)."""
        self._ids.zero_()
        self._positions.zero_()
        self._slots.fill_(self._spare_block * self._block_size)
        self._tables.fill_(self._spare_block)
        self._lens.fill_(1)

    @torch.inference_mode()
    def capture(self) -> bool:
        """Records a graph per bucket (CUDA); keeps them only if a replay matches the eager pass."""
        try:
            self._pad_all()
            pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            for bucket in sorted(self.buckets, reverse=True):  # the largest first: the smaller reuse its pool
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up: kernels compiled, allocations made, outside the graph
                        self._forward(bucket)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(bucket)
                self._graphs[bucket] = (graph, logits)
            if not self._replay_matches_eager():
                self._graphs.clear()
                return False
        except Exception as e:  # an op the capture does not allow, out of memory, ...
            logger.warning("CUDA graphs for decode steps are unavailable, decode steps run eagerly: %s", e)
            self._graphs.clear()
            return False
        finally:
            self._pad_all()
        logger.info("decode steps: CUDA graphs for batch sizes %s", ",".join(map(str, self.buckets)))
        return True

    def _replay_matches_eager(self) -> bool:
        """A few rows with random tokens and contexts in the spare block (distinct positions: rows that wrote
        the same cache slot would leave whichever write came last), the graph's logits vs the eager pass's."""
        bucket = max(b for b in self.buckets if b <= max(1, min(4, self._block_size)))
        gen = torch.Generator().manual_seed(0)
        vocab = int(self._graphs[bucket][1].shape[-1])
        lens = torch.randperm(self._block_size, generator=gen)[:bucket] + 1
        self._ids[0, :bucket].copy_(torch.randint(0, vocab, (bucket,), generator=gen))
        self._positions[0, :bucket].copy_(lens - 1)
        self._slots[:bucket].copy_(self._spare_block * self._block_size + lens - 1)
        self._lens[:bucket].copy_(lens)
        eager = self._forward(bucket).float()
        graph, logits = self._graphs[bucket]
        graph.replay()
        torch.cuda.synchronize()
        if not torch.allclose(logits.float(), eager, atol=1e-3, rtol=1e-3):
            error = float((logits.float() - eager).abs().max())
            logger.warning("a CUDA graph replay of the decode step differs from the eager pass (max error "
                           "%.3g): decode steps run eagerly", error)
            return False
        return True
