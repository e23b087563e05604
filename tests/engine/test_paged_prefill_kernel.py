"""The compiled CPU prefill-attention kernel against attention computed directly in float64.

A prefill chunk's rows are decode rows of growing context over one block table, so the decode kernel's float64
yardstick serves: chunks that start a sequence and chunks that continue one, several chunks of different
lengths in one call, GQA groups (including ones that do not divide the kernel's groups of 4 query vectors),
head sizes that are not a multiple of 8, sliding windows, soft-capping, other block sizes and every dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_server.engine import attention, cpu_kernels, model_runner
from engine_server.engine.attention import PagedMetadata, PrefillBatch, paged_attention_forward
from engine_server.engine.llm_engine import LLMEngine
from engine_testutil import (
    DECODE_BLOCK,
    DECODE_DTYPES,
    DEVICE,
    KERNEL_VARIANTS,
    assert_greedy_like_transformers,
    cpu_kernel_variant,
    decode_case,
    engine_config,
    float64_decode_attention,
)

# (start, rows) of each chunk in one call: first chunks, continuations, 1 and 2 rows, runs across blocks
CHUNKS = [(0, 100), (37, 41), (0, 2), (16, 16), (250, 7), (5, 1), (0, 33)]
CASES = [
    # kv_heads, group, d, window, softcap
    (2, 2, 16, 0, 0.0),  # the tiny model's shape: 2 rows x 2 heads per group of 4
    (1, 1, 64, 0, 0.0),  # 4 rows per group
    (3, 3, 20, 0, 0.0),  # 1 row x 3 heads; a head size past whole 8-lane runs
    (1, 5, 12, 0, 0.0),  # 4 heads + 1 head per row
    (1, 8, 64, 0, 0.0),
    (4, 2, 80, 0, 0.0),
    (2, 2, 16, 7, 0.0),  # a window shorter than most chunks, not a multiple of 8
    (2, 3, 64, 40, 0.0),
    (2, 2, 64, 0, 30.0),
]


@pytest.fixture(scope="module", params=KERNEL_VARIANTS)
def kernel(request: pytest.FixtureRequest) -> Callable[..., None]:
    fn: Callable[..., None] = cpu_kernel_variant(request.param).paged_prefill_attention
    return fn


def prefill_case(seed: int, chunks: list[tuple[int, int]], *, kv_heads: int, group: int, d: int,
                 dtype: torch.dtype, block_size: int = DECODE_BLOCK) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, chunk tables, starts, num_rows, row tables, row lengths): the chunks' rows as
    the kernel takes them and, expanded one per row, as the float64 reference takes them."""
    lens = [start + rows for start, rows in chunks]
    _, k_cache, v_cache, tables, _ = decode_case(seed, kv_heads=kv_heads, group=group, d=d, dtype=dtype,
                                                 lens=lens, block_size=block_size)
    num_rows = torch.tensor([rows for _, rows in chunks])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(int(num_rows.sum()), kv_heads, group, d, generator=gen).to(dtype)
    row_lens = torch.tensor([p + 1 for start, rows in chunks for p in range(start, start + rows)])
    return (q, k_cache, v_cache, tables, torch.tensor([start for start, _ in chunks]), num_rows,
            tables.repeat_interleave(num_rows, dim=0), row_lens)


@pytest.mark.parametrize(("dtype", "tolerance"), DECODE_DTYPES)
@pytest.mark.parametrize(("kv_heads", "group", "d", "window", "softcap"), CASES)
def test_kernel_matches_float64_attention(kernel: Callable[..., None], dtype: torch.dtype, tolerance: float,
                                          kv_heads: int, group: int, d: int, window: int,
                                          softcap: float) -> None:
    q, k_cache, v_cache, tables, starts, num_rows, row_tables, row_lens = prefill_case(
        d + group, CHUNKS, kv_heads=kv_heads, group=group, d=d, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    kernel(q, k_cache, v_cache, tables, starts, num_rows, d ** -0.5, window, softcap, out)
    expected = float64_decode_attention(q, k_cache, v_cache, row_tables, row_lens, scale=d ** -0.5,
                                        window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("block_size", [8, 32])
def test_kernel_walks_other_block_sizes_and_long_chunks(kernel: Callable[..., None], block_size: int) -> None:
    chunks = [(0, 600), (block_size - 1, block_size + 2), (3 * block_size + 5, 70)]
    q, k_cache, v_cache, tables, starts, num_rows, row_tables, row_lens = prefill_case(
        block_size, chunks, kv_heads=2, group=2, d=32, dtype=torch.float32, block_size=block_size)
    out = torch.full_like(q, float("nan"))
    kernel(q, k_cache, v_cache, tables, starts, num_rows, 0.3, 0, 0.0, out)
    expected = float64_decode_attention(q, k_cache, v_cache, row_tables, row_lens, scale=0.3, window=0,
                                        softcap=0.0)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_kernel_refuses_chunks_that_do_not_fit(kernel: Callable[..., None]) -> None:
    q, k_cache, v_cache, tables, starts, num_rows, _, _ = prefill_case(
        1, [(0, 20), (3, 5)], kv_heads=2, group=2, d=16, dtype=torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="add up"):
        kernel(q[:-1].contiguous(), k_cache, v_cache, tables, starts, num_rows, 0.25, 0, 0.0, out[:-1])
    with pytest.raises(RuntimeError, match="outside its block table"):
        kernel(q, k_cache, v_cache, tables, starts + 100, num_rows, 0.25, 0, 0.0, out)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(q.double(), k_cache, v_cache, tables, starts, num_rows, 0.25, 0, 0.0, out.double())


def test_attention_layer_uses_the_kernel_for_prefill_chunks(kernel: Callable[..., None]) -> None:
    """paged_attention_forward with a PrefillBatch after 2 decode rows: the chunks' rows come from the kernel,
    in the layer's layout, and this step's K/V are in the cache before they are read."""
    kv_heads, group, d = 2, 2, 16
    chunks = [(0, 12), (20, 9)]
    q, k_cache, v_cache, tables, starts, num_rows, row_tables, row_lens = prefill_case(
        3, chunks, kv_heads=kv_heads, group=group, d=d, dtype=torch.float32)
    slots = torch.tensor([int(row_tables[r, p // DECODE_BLOCK]) * DECODE_BLOCK + p % DECODE_BLOCK
                          for r, p in enumerate((row_lens - 1).tolist())])
    new_k = torch.randn(1, kv_heads, q.shape[0], d)
    new_v = torch.randn(1, kv_heads, q.shape[0], d)
    calls: list[Any] = []

    def counting_kernel(*args: Any) -> None:
        calls.append(args)
        kernel(*args)

    meta = PagedMetadata(kv_caches=[(k_cache, v_cache)], slot_mapping=slots,
                         prefill_batch=PrefillBatch(0, q.shape[0], tables, starts, num_rows, counting_kernel))
    query = q.flatten(1, 2).transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, d] as transformers passes it
    out, _ = paged_attention_forward(torch.nn.Module(), query, new_k, new_v, None, scaling=0.5,
                                     paged_metadata=meta)
    assert len(calls) == 1
    assert torch.equal(k_cache.flatten(0, 1)[slots], new_k[0].transpose(0, 1))  # written before it was read
    expected = float64_decode_attention(q, k_cache, v_cache, row_tables, row_lens, scale=0.5, window=0,
                                        softcap=0.0)
    torch.testing.assert_close(out[0].double(), expected.flatten(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU prefill kernel")
def test_engine_attends_short_prefill_chunks_with_the_kernel(model_dir: Path, ref_model: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill chunks (first ones and continuations) whose context is at most kernel_prefill_max_context
    positions go to the prefill kernel, all of a step's in one call; longer ones stay on SDPA; the decode
    kernel gets decode rows only; the tokens are transformers' own."""
    sdpa_key_lens: list[int] = []
    sdpa = attention._attention

    def spy(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        sdpa_key_lens.append(k.shape[-2])
        return sdpa(q, k, *args, **kwargs)

    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=128, max_num_batched_tokens=64))
    monkeypatch.setattr(attention, "_attention", spy)  # after the load's own check pass
    runner = engine.runner
    assert runner is not None
    assert runner.prefill_kernel is not None
    assert runner.decode_kernel is not None
    prefill_kernel, decode_kernel = runner.prefill_kernel, runner.decode_kernel
    chunk_calls: list[list[tuple[int, int]]] = []  # per call: (start, rows) of each chunk
    decode_rows: list[int] = []

    def counting_prefill(*args: Any) -> None:
        chunk_calls.append(list(zip(args[4].tolist(), args[5].tolist(), strict=True)))
        prefill_kernel(*args)

    def counting_decode(*args: Any) -> None:
        decode_rows.append(args[0].shape[0])
        decode_kernel(*args)

    runner.prefill_kernel, runner.decode_kernel = counting_prefill, counting_decode
    limit = model_runner.kernel_prefill_max_context(cpu_kernels.load().isa())  # type: ignore[union-attr]
    # 64-token chunks: the 150-token prompt entirely in the kernel, the longer one's last chunk on SDPA
    assert_greedy_like_transformers(engine, ref_model, (150, limit + 44, 20, 33), seed=5, max_tokens=5)
    assert sdpa_key_lens
    assert min(sdpa_key_lens) > limit
    chunks = [chunk for call in chunk_calls for chunk in call]
    assert any(start > 0 for start, _ in chunks)  # a continuation chunk
    assert any(len(call) > 1 for call in chunk_calls)  # several sequences' chunks in one call
    assert all(start + rows <= limit for start, rows in chunks)
    layers = len(runner.kv_caches)
    assert decode_rows
    assert sum(decode_rows) <= layers * 4 * 5  # decode rows only: 4 requests x 5 tokens, per layer
