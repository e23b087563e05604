"""Paged attention for any transformers model, plugged in through its AttentionInterface.

The model runs on one flattened batch [1, num_tokens] with explicit position_ids; per-step
metadata reaches this function as a forward kwarg (`paged_metadata`), so nothing is global.
Each layer first writes this step's K/V into the paged cache (slot mapping), then attends:
- decode tokens (one query per sequence) of all sequences together: their contexts are gathered
  into one padded batch with a key mask and one SDPA call;
- prefill chunks one sequence at a time, with a causal mask offset by the cached context.
Unlike a block-diagonal mask over the whole batch, the cost stays linear in the batch size.

Not supported (exact only within their limits): sliding windows and logit soft-capping.
"""

from __future__ import annotations

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
    # None when the chunk starts the sequence (attend to the step's own K/V, causal);
    # else the cache slots of positions [0, context_len) and a [q_len, context_len] bool mask.
    context_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class PagedMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_slots, kv_heads, head_dim] x2
    slot_mapping: torch.Tensor  # [num_tokens]: where each new token's K/V goes
    num_decode: int = 0  # the first num_decode tokens are single-token queries, one per sequence
    decode_slots: torch.Tensor | None = None  # [num_decode, max_context]
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_context], True = attend
    prefills: list[PrefillChunk] = field(default_factory=list)


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
    # 1) write this step's K/V into the paged cache
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))
    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    gqa = num_heads != key.shape[1]
    out = query.new_empty(num_tokens, num_heads, head_dim)
    # 2) all decode tokens in one padded SDPA call
    n = meta.num_decode
    if n:
        if meta.decode_slots is None or meta.decode_mask is None:
            raise RuntimeError("decode metadata missing")
        q = query[0, :, :n].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, d]
        k = k_cache[meta.decode_slots].transpose(1, 2)  # [n, kv_heads, ctx, d]
        v = v_cache[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=gqa)
        out[:n] = o[:, :, 0]
    # 3) prefill chunks, one sequence at a time
    for chunk in meta.prefills:
        q = query[:, :, chunk.q_start:chunk.q_end]
        if chunk.context_slots is None:
            k = key[:, :, chunk.q_start:chunk.q_end]
            v = value[:, :, chunk.q_start:chunk.q_end]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            k = k_cache[chunk.context_slots].transpose(0, 1).unsqueeze(0)
            v = v_cache[chunk.context_slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scaling, enable_gqa=gqa)
        out[chunk.q_start:chunk.q_end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def register_paged_attention() -> str:
    """Registers the function with transformers (idempotent) and returns its implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
