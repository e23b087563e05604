"""Turns a scheduled step into one flattened forward pass over the paged KV cache."""

from __future__ import annotations

import array
import contextlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_server.engine import cpu_kernels, host_memory, packed_linears
from engine_server.engine.attention import DecodeBatch, DecodeGroup, PagedMetadata, PrefillBatch, PrefillChunk
from engine_server.engine.cpu_kernels import CpuKernels
from engine_server.engine.fused_modules import fuse_modules, rotary_kernel_active
from engine_server.engine.loader import KVShape
from engine_server.engine.lora.context import lora_active
from engine_server.engine.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from engine_server.engine.decode_graphs import DecodeGraphs
    from engine_server.engine.lora.manager import LoraManager

logger = logging.getLogger(__name__)

DECODE_GROUP_MIN = 8  # fewer sequences than this are not worth their own SDPA call
# On CPU, prefill chunks whose context (start + new tokens) is at most this many positions are attended by
# the compiled prefill kernel, all in one call; longer ones by SDPA (flash attention), which gains on it as
# contexts grow. Chunks of 100 to 1024 positions, one thread, a 2-vCPU AMD EPYC (AVX2), against batched causal
# SDPA on contiguous tensors (what a first chunk gets; a continuation's SDPA also needs its context gathered
# and a mask): head_dim 16 0.6-0.7x of SDPA's time at 100 to 512 positions; head_dim 64 ~0.9x at 100 to 256,
# 1.5x at 1024; head_dim 128 (4 query heads per kv head) 0.7x at 256. On an AVX-512 machine (2-vCPU AMD EPYC,
# Zen 4; one chunk from position 0, bf16 and fp32): 0.63-0.87x at 512 positions (head_dim 32, 64 and 128),
# 0.88-1.22x at 1000: there the limit is 512.
def kernel_prefill_max_context(isa: str) -> int:
    """The longest context (positions) of a prefill chunk the kernel attends, for its build's ISA."""
    return 512 if isa == "avx512" else 256


@dataclass(slots=True)
class StepLogits:
    """Logits of the rows the step asked for, and where each scheduled sequence's rows are."""

    logits: torch.Tensor  # [num_rows, vocab] float32
    sample_rows: dict[int, int]  # seq_id -> row of the logits that predicts its next token
    prompt_rows: dict[int, tuple[int, int, int]]  # seq_id -> (first row, num rows, first prompt position)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, kv: KVShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, max_num_seqs: int = 256,
                 max_model_len: int = 2048) -> None:
        self.model = model
        self._has_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.block_size = block_size
        self.device = device
        if device.type == "cuda":
            # NOTE: cuDNN's SDPA backend builds an execution plan for every new shape (hundreds of ms for the
            # first call of a shape on an H200), and a continuously batched engine changes its attention
            # shapes every step (sequences per decode group, context lengths, prefill batches). The flash and
            # memory-efficient backends have no per-shape set-up. Process-wide: the engine owns its process.
            torch.backends.cuda.enable_cudnn_sdp(False)
        # Decode attention reads the paged cache in place: on CPU through the engine's compiled kernel, on
        # CUDA through its Triton kernel (once it has matched torch on this device); else gather + SDPA.
        kernels = cpu_kernels.load() if device.type == "cpu" else None
        self.decode_kernel: Callable[..., None] | None = None
        self.prefill_kernel: Callable[..., None] | None = None
        self._kernel_prefill_max = 0  # prefill chunks the prefill kernel attends: contexts up to this long
        self._rotary_kernels: CpuKernels | None = None  # where its forward passes rotate with the kernel
        if kernels is not None:
            self.decode_kernel = kernels.paged_decode_attention
            self.prefill_kernel = kernels.paged_prefill_attention
            self._kernel_prefill_max = kernel_prefill_max_context(kernels.isa())
            fused = fuse_modules(model, kernels)
            self._rotary_kernels = kernels if fused["rotary"] else None
            logger.info("fused CPU kernels: %d RMSNorm and %d gated-SiLU MLP modules, rotary embedding in %d "
                        "modeling files", fused["rms_norm"], fused["silu_mlp"], fused["rotary"])
        elif device.type == "cuda":
            # NOTE: the GPU-only modules are imported only here, on CUDA (a CPU engine never loads triton:
            # engine/gpu_modules.py)
            from engine_server.engine import triton_decode

            self.decode_kernel = triton_decode.load(
                device, dtype, kv_heads=kv.num_kv_heads, group=kv.num_heads // kv.num_kv_heads,
                head_dim=kv.head_dim, block_size=block_size)
        if device.type == "cpu" and packed_linears.available(dtype):
            packed = packed_linears.pack_linears(model, kernels)
            logger.info("packed oneDNN linears: q/k/v of %d attention layers, %d gated MLPs, %d other "
                        "linears", packed["qkv"], packed["mlp"], packed["linear"])
        # NOTE: one block more than the block manager hands out: the padding rows of a CUDA-graph decode step
        # read and write only that one (decode_graphs.py)
        self.spare_block = num_blocks
        shape = (num_blocks + 1, block_size, kv.num_kv_heads, kv.head_dim)
        self.kv_caches = [(self._zeros(shape, dtype), self._zeros(shape, dtype))
                          for _ in range(kv.num_layers)]
        self.lora: LoraManager | None = None  # set by the engine where it serves LoRA adapters
        self.decode_graphs: DecodeGraphs | None = None
        if device.type == "cuda" and self.decode_kernel is not None and self._has_logits_to_keep:
            from engine_server.engine import decode_graphs

            if decode_graphs.enabled():
                graphs = decode_graphs.DecodeGraphs(
                    model, kv_caches=self.kv_caches, kernel=self.decode_kernel, max_batch=max_num_seqs,
                    max_blocks=-(-max_model_len // block_size), block_size=block_size,
                    spare_block=self.spare_block, device=device)
                self.decode_graphs = graphs if graphs.capture() else None

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return host_memory.zeros(shape, dtype)  # in huge pages: see host_memory.py
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _int64(self, values: list[int]) -> torch.Tensor:
        """A 1-D int64 tensor of `values` on the device.

        NOTE: torch.tensor(list) converts element by element through Python (~55 ns each); array packs them
        in C (~15 ns): ~0.2 ms of a decode step at 256 sequences (block tables, slots, ids, positions).
        """
        if not values:
            return torch.empty(0, dtype=torch.long, device=self.device)
        host = torch.frombuffer(array.array("q", values), dtype=torch.long)
        return host if self.device.type == "cpu" else host.to(self.device)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[StepLogits, list[ScheduledSeq]]:
        """Runs the model; returns the logits and the order the sequences were laid out in."""
        # NOTE: single-token queries (decodes, and 1-token chunks) go first so they share one SDPA call.
        # Sorted by context length so that each decode group pads little.
        decodes = sorted((s for s in scheduled if s.num_new_tokens == 1), key=lambda s: s.start)
        graphs = self.decode_graphs
        has_lora = self.lora is not None and any(s.seq.lora_slot >= 0 for s in scheduled)
        if graphs is not None and not has_lora and len(decodes) == len(scheduled) and graphs.fits(decodes):
            rows = {s.seq.seq_id: i for i, s in enumerate(decodes)}
            return StepLogits(graphs.run(decodes).float(), rows, {}), decodes
        # Short chunks right after the decodes (the prefill kernel's rows are one contiguous run); then first
        # chunks of equal length side by side: each run of them is one batched attention call.
        limit = self._kernel_prefill_max

        def in_kernel(s: ScheduledSeq) -> bool:  # a prefill chunk the kernel attends
            return s.start + s.num_new_tokens <= limit

        prefills = sorted((s for s in scheduled if s.num_new_tokens > 1),
                          key=lambda s: (not in_kernel(s), s.start > 0, s.num_new_tokens))
        kernel_chunks = [s for s in prefills if in_kernel(s)]
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        keep: list[int] = []
        sample_rows: dict[int, int] = {}
        prompt_rows: dict[int, tuple[int, int, int]] = {}
        chunks: list[PrefillChunk] = []
        size = self.block_size
        for s in decodes:
            # NOTE: the general body below, written out for one token (~2x faster: most of a step's rows)
            seq, start = s.seq, s.start
            q_start = len(input_ids)
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slot_mapping.append(seq.block_table[start // size] * size + start % size)
            if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens - 1:  # a prompt's 1-token chunk
                prompt_rows[seq.seq_id] = (len(keep), 1, start)
                keep.append(q_start)
            if s.completes:
                sample_rows[seq.seq_id] = len(keep)
                keep.append(q_start)
        for s in prefills:
            seq, start, end = s.seq, s.start, s.start + s.num_new_tokens
            q_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(seq.block_table, start, end))
            if not in_kernel(s):
                self._add_prefill_chunk(chunks, s, q_start)
            if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens - 1:
                # position p's logits score prompt token p + 1
                last = min(end, seq.num_prompt_tokens - 1)
                prompt_rows[seq.seq_id] = (len(keep), last - start, start)
                keep.extend(range(q_start, q_start + last - start))
            if s.completes:
                sample_rows[seq.seq_id] = len(keep)
                keep.append(q_start + s.num_new_tokens - 1)
        meta = PagedMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=self._int64(slot_mapping),
            prefills=chunks,
        )
        if kernel_chunks and self.prefill_kernel is not None:
            meta.prefill_batch = self._prefill_batch(kernel_chunks, len(decodes), self.prefill_kernel)
        if decodes and self.decode_kernel is not None:
            meta.decode_batch = self._decode_batch(decodes, self.decode_kernel)
        else:
            group_start = 0
            for group_end in self._decode_group_ends(decodes):
                meta.decodes.append(self._decode_group(decodes, group_start, group_end))
                group_start = group_end
        ids = self._int64(input_ids).view(1, -1)
        pos = self._int64(positions).view(1, -1)
        keep_t = self._int64(keep)
        rotary = self._rotary_kernels
        lora_step = None
        if has_lora:
            assert self.lora is not None
            # each row's slot, in the order the rows were laid out: the decodes', then each prefill chunk's
            row_slots = [s.seq.lora_slot for s in decodes]
            for s in prefills:
                row_slots += [s.seq.lora_slot] * s.num_new_tokens
            lora_step = self.lora.step(row_slots)
        with (rotary_kernel_active(rotary) if rotary is not None else contextlib.nullcontext(),
              lora_active(lora_step)):
            if self._has_logits_to_keep:
                logits = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep_t,
                                    paged_metadata=meta).logits[0]
            else:  # an older model class: project every position, then pick
                logits = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                                    paged_metadata=meta).logits[0].index_select(0, keep_t)
        return StepLogits(logits.float(), sample_rows, prompt_rows), decodes + prefills

    def check_model(self) -> None:
        """One throwaway forward pass, so an unsupported model fails at load with a clear error.

        NOTE: it writes one token's K/V into block 0, which is free; a block is always written
        before it is read, so nothing stale can leak into a sequence.
        """
        meta = PagedMetadata(kv_caches=self.kv_caches,
                             slot_mapping=torch.arange(2, dtype=torch.long, device=self.device),
                             prefills=[PrefillChunk(0, 2, context_len=2)])
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        try:
            with torch.inference_mode():
                self.model(input_ids=ids, position_ids=torch.arange(2, device=self.device)[None],
                           use_cache=False, paged_metadata=meta)
        except Exception as e:
            name = type(self.model).__name__
            raise ValueError(f"model {name} cannot run with the engine's paged attention (its layers must "
                             f"call transformers' attention interface and pass forward kwargs through): "
                             f"{e}") from e

    def _add_prefill_chunk(self, chunks: list[PrefillChunk], s: ScheduledSeq, q_start: int) -> None:
        last = chunks[-1] if chunks else None
        if (s.start == 0 and last is not None and last.context_blocks is None
                and last.context_len == s.num_new_tokens and last.q_end == q_start):
            last.q_end += s.num_new_tokens  # another first chunk of the same length: joins the batch
            last.num_seqs += 1
            return
        chunks.append(self._prefill_chunk(s, q_start))

    def _prefill_chunk(self, s: ScheduledSeq, q_start: int) -> PrefillChunk:
        q_end = q_start + s.num_new_tokens
        if s.start == 0:
            return PrefillChunk(q_start, q_end, context_len=s.num_new_tokens)
        context_len = s.start + s.num_new_tokens
        num_blocks = -(-context_len // self.block_size)
        blocks = torch.tensor(s.seq.block_table[:num_blocks], dtype=torch.long, device=self.device)
        query_pos = torch.arange(s.start, context_len, device=self.device)
        mask = torch.arange(context_len, device=self.device)[None, :] <= query_pos[:, None]
        return PrefillChunk(q_start, q_end, blocks, context_len, mask)

    def _decode_group_ends(self, decodes: list[ScheduledSeq]) -> list[int]:
        """Splits the length-sorted decodes where padding to the group's longest would waste > 1/4."""
        ends: list[int] = []
        first = 0
        for i in range(1, len(decodes) + 1):
            if i == len(decodes):
                ends.append(i)
                break
            limit = (decodes[first].start + 1) * 4 // 3 + self.block_size
            if decodes[i].start + 1 > limit and i - first >= DECODE_GROUP_MIN:
                ends.append(i)
                first = i
        return ends

    def _block_tables(self, seqs: list[ScheduledSeq], context_lens: list[int]) -> torch.Tensor:
        """[n, max_blocks] block tables of `seqs`, each covering its context length (padded with block 0)."""
        max_blocks = -(-max(context_lens) // self.block_size)
        padding = [0] * max_blocks
        tables: list[int] = []
        for s in seqs:
            table = s.seq.block_table
            if len(table) >= max_blocks:
                tables += table[:max_blocks]
            else:
                tables += table
                tables += padding[:max_blocks - len(table)]
        return self._int64(tables).view(len(seqs), max_blocks)

    def _decode_tables(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Context lengths [n] and block tables [n, max_blocks] of decoding `seqs` (one new token each)."""
        context_lens = [s.start + 1 for s in seqs]
        return self._int64(context_lens), self._block_tables(seqs, context_lens)

    def _prefill_batch(self, chunks: list[ScheduledSeq], q_start: int,
                       kernel: Callable[..., None]) -> PrefillBatch:
        num_rows = [s.num_new_tokens for s in chunks]
        tables = self._block_tables(chunks, [s.start + s.num_new_tokens for s in chunks])
        return PrefillBatch(q_start=q_start, q_end=q_start + sum(num_rows), block_tables=tables,
                            starts=self._int64([s.start for s in chunks]), num_rows=self._int64(num_rows),
                            kernel=kernel)

    def _decode_batch(self, seqs: list[ScheduledSeq], kernel: Callable[..., None]) -> DecodeBatch:
        context_lens, tables = self._decode_tables(seqs)
        return DecodeBatch(q_start=0, q_end=len(context_lens), block_tables=tables, context_lens=context_lens,
                           kernel=kernel)

    def _decode_group(self, decodes: list[ScheduledSeq], first: int, end: int) -> DecodeGroup:
        lens_t, tables = self._decode_tables(decodes[first:end])
        pos = torch.arange(tables.shape[1] * self.block_size, device=self.device)
        past = pos[None, :] >= lens_t[:, None]
        mask = torch.zeros(past.shape, dtype=self.kv_caches[0][0].dtype, device=self.device)
        return DecodeGroup(q_start=first, q_end=end, blocks=tables.view(-1),
                           mask=mask.masked_fill_(past, float("-inf"))[:, None, None, :], context_lens=lens_t)
