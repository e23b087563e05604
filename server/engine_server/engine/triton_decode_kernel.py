"""The Triton source of the CUDA engine's decode attention (engine/triton_decode.py launches and checks it).

A module of its own: Triton compiles a kernel from its function's source and resolves the names it uses
(`tl`) in the module's globals, and importing triton (~0.2 s) is nothing a CPU engine needs. With
TRITON_INTERPRET=1 set before the import, the kernel runs in Triton's interpreter (on CPU tensors: the tests).

One program per (sequence, kv head): the query heads sharing that kv head, the sequence's context tile by
tile (positions mapped to cache slots through the block table), an online softmax in float32.
"""

# NOTE: no `from __future__ import annotations`: Triton reads the constexpr annotations as objects (older
# versions do not parse string annotations).
from typing import Any

import triton
import triton.language as tl


@triton.jit  # type: ignore[misc]
def paged_decode(q_ptr: Any, k_ptr: Any, v_ptr: Any, tables_ptr: Any, lens_ptr: Any, out_ptr: Any,
                 scale: Any, softcap: Any, window: Any, stride_table: Any, stride_block: Any,
                 stride_pos: Any, stride_head: Any, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_D: tl.constexpr, TILE: tl.constexpr, USE_SOFTCAP: tl.constexpr) -> None:
    seq = tl.program_id(0)
    head = tl.program_id(1)
    length = tl.load(lens_ptr + seq)
    start = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gd_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    # q and out: [n, kv_heads, group, d], contiguous
    row = (seq * KV_HEADS + head) * GROUP * HEAD_DIM + g[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + row, mask=gd_mask, other=0.0).to(tl.float32) * scale
    top = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(start, length, TILE):
        pos = first + tl.arange(0, TILE)
        live = pos < length
        block = tl.load(tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=live, other=0)
        cell = block * stride_block + (pos % BLOCK_SIZE) * stride_pos + head * stride_head
        kv_mask = live[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + cell[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, TILE]
        if USE_SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp -> 0, inf)
            scores = (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0)) * softcap
        scores = tl.where(live[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        rescale = tl.exp(top - new_top)  # 0 on the first tile (top = -inf)
        p = tl.exp(scores - new_top[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        v = tl.load(v_ptr + cell[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        top = new_top
    result = acc / total[:, None]
    tl.store(out_ptr + row, result.to(out_ptr.dtype.element_ty), mask=gd_mask)
