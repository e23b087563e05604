"""First prefill chunks of equal length run as one batched attention call, with the same result as one call
per sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_server.engine import attention, model_runner
from engine_server.engine.attention import PagedMetadata, PrefillChunk, paged_attention_forward
from engine_server.engine.llm_engine import LLMEngine
from engine_testutil import DEVICE, assert_greedy_like_transformers, engine_config

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 8


def _attend(chunks: list[PrefillChunk], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            **kwargs: Any) -> torch.Tensor:
    num_tokens = q.shape[2]
    cache = torch.zeros(-(-num_tokens // BLOCK), BLOCK, KV_HEADS, HEAD_DIM, device=DEVICE)
    meta = PagedMetadata(kv_caches=[(cache.clone(), cache.clone())],
                         slot_mapping=torch.arange(num_tokens, device=DEVICE), prefills=chunks)
    out, _ = paged_attention_forward(torch.nn.Module(), q, k, v, None, paged_metadata=meta, **kwargs)
    return out


@pytest.mark.parametrize("kwargs", [{}, {"sliding_window": 5}, {"sliding_window": 64}, {"softcap": 2.0},
                                    {"scaling": 0.3}])
def test_batched_first_chunks_equal_one_call_per_sequence(kwargs: dict[str, Any]) -> None:
    n, length = 5, 12
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n * length, HEAD_DIM, generator=gen).to(DEVICE)
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    # the layout transformers hands over: [1, tokens, heads, d] transposed, so not contiguous
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    one_each = [PrefillChunk(i * length, (i + 1) * length, context_len=length) for i in range(n)]
    batched = [PrefillChunk(0, n * length, context_len=length, num_seqs=n)]
    want = _attend(one_each, q, k, v, **kwargs)
    got = _attend(batched, q, k, v, **kwargs)
    torch.testing.assert_close(got, want)
    # and the sequences do not see each other: a change in one leaves the others' outputs alone
    k2 = k.clone()
    k2[:, :, :length] = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=gen).to(DEVICE)
    got2 = _attend(batched, q, k2, v, **kwargs)
    torch.testing.assert_close(got2[:, length:], got[:, length:])
    assert (got2[:, 1:length] - got[:, 1:length]).abs().max() > 0.1  # (position 0 sees only its own key)


def test_engine_batches_equal_length_prompts_and_matches_generate(
        model_dir: Path, ref_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    batch_sizes: list[int] = []
    first_chunks = attention._first_chunks

    def spy(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            chunk: PrefillChunk, **kwargs: Any) -> None:
        batch_sizes.append(chunk.num_seqs)
        first_chunks(out, query, key, value, chunk, **kwargs)

    monkeypatch.setattr(attention, "_first_chunks", spy)
    # on CPU, chunks this short go to the decode kernel; this test is about the SDPA path's batching
    monkeypatch.setattr(model_runner, "kernel_prefill_max_context", lambda isa: 0)
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=128, max_num_batched_tokens=512))
    # lengths 20 (x4, interleaved with others: the runner lays them out side by side) and 33 (x2) are
    # batched; 7 and 35 run alone
    assert_greedy_like_transformers(engine, ref_model, (20, 20, 20, 33, 7, 20, 33, 35), seed=3, max_tokens=6)
    assert engine.runner is not None
    num_layers = len(engine.runner.kv_caches)
    assert sorted(batch_sizes) == [2] * num_layers + [4] * num_layers
