"""Paged attention for any transformers model, plugged in through its AttentionInterface.

The model runs on one flattened batch [1, num_tokens] with explicit position_ids; per-step
metadata reaches this function as a forward kwarg (`paged_metadata`), so nothing is global.
Each layer first writes this step's K/V into the paged cache (slot mapping), then attends:
- decode tokens (one query per sequence) of all sequences together: one call of a kernel that reads the
  paged cache in place (on CPU the engine's compiled one, engine/csrc/; on CUDA its Triton one,
  engine/triton_decode.py); where neither is available, their contexts are gathered into padded groups with
  a key mask and one SDPA call per group;
- on CPU, short prefill chunks (model_runner.kernel_prefill_max_context says how short) in one call of the
  engine's compiled prefill kernel, which also reads the paged cache in place, each token a query row over its
  sequence's positions up to its own;
- other prefill chunks one sequence at a time, with a causal mask offset by the cached context; chunks that
  start their sequences and have the same length (a burst of equal-length prompts) laid out back to back are
  one batched causal SDPA call.
Unlike a block-diagonal mask over the whole batch, the cost stays linear in the batch size.

Sliding windows (the `sliding_window` kwarg of Mistral, Qwen2, Gemma2/3 layers) are applied as
an extra mask. Attention logit soft-capping (the `softcap` kwarg of Gemma2 layers) has no SDPA
form: with it, the same calls run through `_softcapped_attention` (explicit scores, float32 softmax).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "engine_paged"


@dataclass(slots=True)
class PrefillChunk:
    q_start: int  # offset of the chunk in the flattened batch
    q_end: int
    # None when the chunk starts the sequence (attend to the step's own K/V, causal); else the
    # sequence's cache blocks and a [q_len, context_len] bool mask.
    context_blocks: torch.Tensor | None = None
    context_len: int = 0
    mask: torch.Tensor | None = None
    # > 1: that many sequences' first chunks, each context_len tokens, back to back (context_blocks None)
    num_seqs: int = 1


@dataclass(slots=True)
class DecodeGroup:
    """Single-token queries of sequences with similar context lengths, attended in one SDPA call."""

    q_start: int
    q_end: int
    blocks: torch.Tensor  # [num_seqs * max_blocks]: block tables, flattened, padded with block 0
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size]: 0, or -inf past the context
    context_lens: torch.Tensor  # [num_seqs]


@dataclass(slots=True)
class DecodeBatch:
    """Query rows for the paged kernel (cpu_kernels.py, triton_decode.py), each attending its sequence's
    first context_lens[i] positions: every decoding sequence's token, and on CPU each token of short
    prefill chunks."""

    q_start: int
    q_end: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [num_seqs] int64
    kernel: Callable[..., None]


@dataclass(slots=True)
class PrefillBatch:
    """Prefill chunks for the CPU prefill kernel (cpu_kernels.py): their rows are q_start..q_end, chunk after
    chunk; chunk i starts at position starts[i] (the positions before it are in the cache) and has
    num_rows[i] rows, each attending its sequence up to its own position."""

    q_start: int
    q_end: int
    block_tables: torch.Tensor  # [num_chunks, max_blocks] int64, padded with block 0
    starts: torch.Tensor  # [num_chunks] int64
    num_rows: torch.Tensor  # [num_chunks] int64
    kernel: Callable[..., None]


@dataclass(slots=True)
class PagedMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_blocks, block_size, kv_heads, d] x2
    slot_mapping: torch.Tensor  # [num_tokens]: where each new token's K/V goes (block * block_size + offset)
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_batch: DecodeBatch | None = None  # instead of `decodes` where the kernel is available
    prefill_batch: PrefillBatch | None = None  # short chunks, where the CPU prefill kernel is available


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, num_tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    meta: PagedMetadata | None = kwargs.get("paged_metadata")
    if meta is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the paged_metadata forward kwarg")
    k_cache, v_cache = meta.kv_caches[int(getattr(module, "layer_idx", 0))]
    num_blocks, _, num_kv_heads, head_dim = k_cache.shape
    # 1) write this step's K/V into the paged cache
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))
    num_heads, num_tokens = query.shape[1], query.shape[2]
    window = kwargs.get("sliding_window")
    window = int(window) if isinstance(window, int) and window > 0 else None
    softcap = kwargs.get("softcap")
    softcap = float(softcap) if isinstance(softcap, (int, float)) and softcap > 0 else None
    gqa = num_heads != num_kv_heads
    out = query.new_empty(num_tokens, num_heads, head_dim)
    k_blocks = k_cache.view(num_blocks, -1)
    v_blocks = v_cache.view(num_blocks, -1)
    # 2) decode tokens, a group of similar context lengths per padded SDPA call; whole blocks are
    # gathered (index_select is much faster than per-slot indexing), positions past each context masked.
    for group in meta.decodes:
        n = group.q_end - group.q_start
        k = k_blocks.index_select(0, group.blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = v_blocks.index_select(0, group.blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        # NOTE: query heads h*g..h*g+g-1 share kv head h (transformers' repeat_kv order), so the
        # group rides in the query-length axis and no K/V gets repeated.
        q = query[0, :, group.q_start:group.q_end].transpose(0, 1)
        q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        mask = group.mask
        if window is not None:  # keys at or before position (context_len - 1 - window) drop out
            key_pos = torch.arange(mask.shape[-1], device=mask.device)
            old = key_pos[None, :] <= (group.context_lens - 1 - window)[:, None]
            mask = mask.masked_fill(old[:, None, None, :], float("-inf"))
        o = _attention(q, k, v, mask, scaling=scaling, softcap=softcap)
        out[group.q_start:group.q_end] = o.reshape(n, num_heads, head_dim)
    if meta.decode_batch is not None:
        _kernel_decode(meta.decode_batch, query, k_cache, v_cache, out, scaling=scaling, window=window,
                       softcap=softcap)
    if meta.prefill_batch is not None:
        _kernel_prefill(meta.prefill_batch, query, k_cache, v_cache, out, scaling=scaling, window=window,
                        softcap=softcap)
    # 3) prefill chunks, one sequence at a time (or one batch of equal-length first chunks)
    for chunk in meta.prefills:
        if chunk.num_seqs > 1:
            _first_chunks(out, query, key, value, chunk, window=window, scaling=scaling, softcap=softcap,
                          gqa=gqa)
            continue
        q = query[:, :, chunk.q_start:chunk.q_end]
        if window is not None and window < chunk.context_len:
            _prefill_with_window(out, q, k_blocks, v_blocks, chunk, key, value, window=window,
                                 scaling=scaling, softcap=softcap, gqa=gqa)
            continue
        if chunk.context_blocks is None:
            k = key[:, :, chunk.q_start:chunk.q_end]
            v = value[:, :, chunk.q_start:chunk.q_end]
            o = _attention(q, k, v, None, scaling=scaling, softcap=softcap, gqa=gqa)
        else:
            ctx = chunk.context_len
            k = k_blocks.index_select(0, chunk.context_blocks).view(-1, num_kv_heads, head_dim)[:ctx]
            v = v_blocks.index_select(0, chunk.context_blocks).view(-1, num_kv_heads, head_dim)[:ctx]
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = _attention(q, k, v, chunk.mask, scaling=scaling, softcap=softcap, gqa=gqa)
        out[chunk.q_start:chunk.q_end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _kernel_decode(batch: DecodeBatch, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   out: torch.Tensor, *, scaling: float | None, window: int | None,
                   softcap: float | None) -> None:
    n = batch.q_end - batch.q_start
    num_heads, head_dim = query.shape[1], query.shape[3]
    shape = (n, k_cache.shape[2], num_heads // k_cache.shape[2], head_dim)  # [n, kv_heads, group, d]
    q = query[0, :, batch.q_start:batch.q_end].transpose(0, 1).reshape(shape).contiguous()
    scale = head_dim ** -0.5 if scaling is None else scaling
    # the kernel writes straight into the output rows (a contiguous slice of `out`)
    batch.kernel(q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale, window or 0,
                 softcap or 0.0, out[batch.q_start:batch.q_end].view(shape))


def _kernel_prefill(batch: PrefillBatch, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, *, scaling: float | None, window: int | None,
                    softcap: float | None) -> None:
    n = batch.q_end - batch.q_start
    num_heads, head_dim = query.shape[1], query.shape[3]
    shape = (n, k_cache.shape[2], num_heads // k_cache.shape[2], head_dim)  # [n, kv_heads, group, d]
    q = query[0, :, batch.q_start:batch.q_end].transpose(0, 1).reshape(shape).contiguous()
    scale = head_dim ** -0.5 if scaling is None else scaling
    batch.kernel(q, k_cache, v_cache, batch.block_tables, batch.starts, batch.num_rows, scale, window or 0,
                 softcap or 0.0, out[batch.q_start:batch.q_end].view(shape))


def _first_chunks(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  chunk: PrefillChunk, *, window: int | None, scaling: float | None, softcap: float | None,
                  gqa: bool) -> None:
    """num_seqs sequences' first chunks of equal length: one causal (and windowed) attention call, the
    sequences in the batch axis."""
    n, length = chunk.num_seqs, chunk.context_len
    # [1, heads, n * length, d] -> [n, heads, length, d]: views (splitting one axis into n x length needs
    # no copy, whatever the strides)
    q, k, v = (x[0, :, chunk.q_start:chunk.q_end].reshape(x.shape[1], n, length, x.shape[3]).transpose(0, 1)
               for x in (query, key, value))
    mask = _window_mask(length, length, window, q.device) if window is not None and window < length else None
    o = _attention(q, k, v, mask, scaling=scaling, softcap=softcap, gqa=gqa)  # [n, heads, length, d]
    out[chunk.q_start:chunk.q_end] = o.transpose(1, 2).reshape(n * length, o.shape[1], o.shape[3])


def _prefill_with_window(out: torch.Tensor, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                         chunk: PrefillChunk, key: torch.Tensor, value: torch.Tensor, *, window: int,
                         scaling: float | None, softcap: float | None, gqa: bool) -> None:
    """A prefill chunk whose context is longer than the sliding window: causal AND windowed mask."""
    ctx = chunk.context_len
    num_new = chunk.q_end - chunk.q_start
    num_kv_heads, head_dim = key.shape[1], key.shape[3]
    if chunk.context_blocks is None:
        k = key[:, :, chunk.q_start:chunk.q_end]
        v = value[:, :, chunk.q_start:chunk.q_end]
    else:
        k = k_blocks.index_select(0, chunk.context_blocks).view(-1, num_kv_heads, head_dim)[:ctx]
        v = v_blocks.index_select(0, chunk.context_blocks).view(-1, num_kv_heads, head_dim)[:ctx]
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    o = _attention(q, k, v, _window_mask(ctx, num_new, window, q.device), scaling=scaling, softcap=softcap,
                   gqa=gqa)
    out[chunk.q_start:chunk.q_end] = o[0].transpose(0, 1)


def _window_mask(context_len: int, num_new: int, window: int, device: torch.device) -> torch.Tensor:
    """[num_new, context_len] bool, True where a query (the last num_new positions) attends: causal AND
    within the sliding window."""
    query_pos = torch.arange(context_len - num_new, context_len, device=device)[:, None]
    key_pos = torch.arange(context_len, device=device)[None, :]
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
               scaling: float | None, softcap: float | None, gqa: bool = False) -> torch.Tensor:
    """One attention call. `mask`: bool (True attends) or additive; None: causal (q_len == k_len)."""
    if softcap is not None:
        return _softcapped_attention(q, k, v, mask, scaling=scaling, softcap=softcap)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                          scaling: float | None, softcap: float) -> torch.Tensor:
    """Attention with Gemma2's logit soft-capping, as transformers' eager attention computes it (but in
    float32 from the scores on, not only the softmax).

    q: [..., heads, q_len, d]; k, v: [..., kv_heads, k_len, d], where query head h*g+j uses kv head h.
    """
    num_groups = q.shape[-3] // k.shape[-3]
    if num_groups > 1:
        k, v = k.repeat_interleave(num_groups, dim=-3), v.repeat_interleave(num_groups, dim=-3)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (q @ k.transpose(-1, -2) * scale).float()
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def register_paged_attention() -> str:
    """Registers the function with transformers (idempotent) and returns its implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
