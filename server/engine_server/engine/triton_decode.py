"""Decode attention over the paged KV cache on a GPU: one Triton kernel launch per layer.

Why: without it, a CUDA engine gathers each decode group's cache blocks into a padded copy and runs a
masked SDPA per group (engine/attention.py): several launches per group and layer, and a copy of every
context each step. On the H200 (BENCHMARKS.md, "Frontend throughput on a GPU") decode steps were
launch-bound: ~570 launches a step for the 1B model, ~4.4 ms of GPU work in 13-21 ms of wall time. Here one
program per (sequence, kv head) reads that sequence's keys and values in place through its block table,
tile by tile with an online softmax (as vLLM's paged attention and FlashInfer's decode kernels do), for all
the query heads that share the kv head; the launch's shape depends only on the batch (as CUDA graphs need).

Same arguments and results as the CPU kernel (csrc/ops.h): q [n, kv_heads, group, d] (query heads
h*group..h*group+group-1 share kv head h), k_cache / v_cache [num_blocks, block_size, kv_heads, d],
block_tables [n, max_blocks] int64, context_lens [n] int64, out like q; window > 0: only the last `window`
positions are attended; softcap > 0: scores become tanh(s / softcap) * softcap. Scores, softmax and the
weighted sum are float32 whatever the cache dtype.

The kernel runs compiled on CUDA tensors, and on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1:
the tests check it that way on machines without a GPU). `load()` gives the engine the kernel only once it
has reproduced the torch computation on the device: a GPU or Triton version it fails on keeps the torch path
(as does ENGINE_TRITON_DECODE=0).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "ENGINE_TRITON_DECODE"  # =0: the torch path (for comparisons)
# A tile's scores are formed as a [group, positions, head_dim] product in registers: positions per tile are
# chosen so that it holds ~8K floats (16-64 positions), which a program's 4 warps keep without spilling much.
TILE_ELEMENTS = 8192

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int,
                         float, torch.Tensor], None]


def _triton_kernel(on_cpu: bool) -> Any:
    from engine_server.engine.triton_decode_kernel import paged_decode

    if on_cpu and not _interpreted(paged_decode):
        raise ValueError("paged_decode_attention: CPU tensors run only in Triton's interpreter "
                         "(TRITON_INTERPRET=1 set before triton is imported)")
    return paged_decode


def _interpreted(kernel: Any) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int,
                           softcap: float, out: torch.Tensor) -> None:
    """Writes attention of each sequence's query heads over its paged context into `out` (see the module)."""
    n, kv_heads, group, d = q.shape
    if not (q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
            and block_tables.is_contiguous() and out.shape == q.shape and k_cache.shape == v_cache.shape
            and k_cache.shape[2:] == (kv_heads, d)):
        raise ValueError("paged_decode_attention: contiguous q/out [n, kv_heads, group, d] and caches "
                         "[num_blocks, block_size, kv_heads, d] expected")
    if not q.dtype == k_cache.dtype == v_cache.dtype == out.dtype:
        raise ValueError("paged_decode_attention: one dtype expected")
    if n == 0:
        return
    _triton_kernel(on_cpu=not q.is_cuda)[(n, kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, float(scale), float(softcap), int(window),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_G=_pow2(group), BLOCK_D=_pow2(d), TILE=_tile(_pow2(group), _pow2(d)), USE_SOFTCAP=softcap > 0,
    )


def _tile(block_g: int, block_d: int) -> int:
    """Positions per tile (a power of two: block_g and block_d are)."""
    return max(16, min(64, TILE_ELEMENTS // (block_g * block_d)))


def _pow2(x: int) -> int:
    """The smallest power of two >= x (a Triton range's length must be one); the lanes past x are masked."""
    return 1 << (x - 1).bit_length()


def reference_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               window: int, softcap: float) -> torch.Tensor:
    """The same attention in torch ops, a sequence at a time in float32 (the load-time check's yardstick)."""
    block_size = k_cache.shape[1]
    group = q.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for s, length in enumerate(context_lens.tolist()):
        positions = torch.arange(length, device=q.device)
        slots = block_tables[s, positions // block_size] * block_size + positions % block_size
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [length, heads, d]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[s].float().flatten(0, 1), k) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        if window > 0:
            scores[:, positions < length - window] = float("-inf")
        out[s] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v).view(q.shape[1:])
    return out


def load(device: torch.device, dtype: torch.dtype, *, kv_heads: int, group: int, head_dim: int,
         block_size: int) -> DecodeKernel | None:
    """The kernel, if Triton is installed and it reproduces `reference_decode_attention` on this device for
    the model's shapes and dtype (a sliding window and soft-capping included); else None, and the engine
    keeps its torch path."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        logger.info("%s=0: decode attention on %s stays on the torch path", DISABLE_ENV, device)
        return None
    try:
        import triton  # noqa: F401  (installed with torch on Linux; optional elsewhere)
    except ImportError:
        logger.info("triton is not installed: decode attention on %s stays on the torch path", device)
        return None
    gen = torch.Generator().manual_seed(0)
    lens = [1, block_size - 1, block_size + 1, 3 * 64 + 5]  # the last one spans several tiles
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    q = torch.randn(len(lens), kv_heads, group, head_dim, generator=gen).to(device, dtype)
    max_blocks = -(-max(lens) // block_size)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1  # scattered blocks, block 0 unused
    used = 0
    for i, n in enumerate(lens):
        count = -(-n // block_size)
        tables[i, :count] = order[used:used + count]
        used += count
    tables_d = tables.to(device)
    lens_d = torch.tensor(lens, dtype=torch.long, device=device)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    try:
        for window, softcap in ((0, 0.0), (block_size + 3, 0.0), (0, 20.0)):
            out = torch.empty_like(q)
            scale = head_dim ** -0.5
            paged_decode_attention(q, k_cache, v_cache, tables_d, lens_d, scale, window, softcap, out)
            expected = reference_decode_attention(q, k_cache, v_cache, tables_d, lens_d, scale, window,
                                                  softcap)
            if not torch.allclose(out.float(), expected, atol=tolerance, rtol=tolerance):
                error = float((out.float() - expected).abs().max())
                logger.warning("the Triton decode kernel differs from torch on %s (max error %.3g, window "
                               "%d, softcap %s): decode attention stays on the torch path", device, error,
                               window, softcap)
                return None
    except Exception as e:  # no compiler for this GPU, an unsupported Triton version, ...
        logger.warning("the Triton decode kernel is unavailable on %s, decode attention stays on the torch "
                       "path: %s", device, e)
        return None
    logger.info("decode attention on %s: the Triton paged kernel", device)
    return paged_decode_attention
