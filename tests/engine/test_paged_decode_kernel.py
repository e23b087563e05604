"""The compiled CPU decode-attention kernel against attention computed directly in float64.

Random paged caches with scattered block tables; GQA groups, a head size that is not a multiple of
16 (the kernel's masked tail lanes), sliding windows, soft-capping, and every dtype the engine serves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_server.engine import cpu_kernels
from engine_server.engine.attention import DecodeBatch, PagedMetadata, paged_attention_forward
from engine_testutil import (
    DECODE_BLOCK,
    DECODE_CASES,
    DECODE_DTYPES,
    DECODE_LENS,
    KERNEL_VARIANTS,
    cpu_kernel_variant,
    decode_case,
    float64_decode_attention,
)


@pytest.fixture(scope="module", params=KERNEL_VARIANTS)
def kernel(request: pytest.FixtureRequest) -> Callable[..., None]:
    fn: Callable[..., None] = cpu_kernel_variant(request.param).paged_decode_attention
    return fn


@pytest.mark.parametrize(("dtype", "tolerance"), DECODE_DTYPES)
@pytest.mark.parametrize(("kv_heads", "group", "d", "window", "softcap"), DECODE_CASES)
def test_kernel_matches_float64_attention(kernel: Callable[..., None], dtype: torch.dtype, tolerance: float,
                                          kv_heads: int, group: int, d: int, window: int,
                                          softcap: float) -> None:
    lens = DECODE_LENS
    q, k_cache, v_cache, tables, lens_t = decode_case(d + group, kv_heads=kv_heads, group=group, d=d,
                                                      dtype=dtype, lens=lens)
    out = torch.full_like(q, float("nan"))
    kernel(q, k_cache, v_cache, tables, lens_t, d ** -0.5, window, softcap, out)
    # reference on the same (rounded) inputs; the kernel's own rounding is its output dtype's
    expected = float64_decode_attention(q, k_cache, v_cache, tables, lens_t, scale=d ** -0.5, window=window,
                                        softcap=softcap)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize(("kv_heads", "d", "window"), [(2, 16, 0), (4, 64, 0), (4, 64, 37)])
def test_kernel_walks_other_block_sizes_and_long_contexts(kernel: Callable[..., None], block_size: int,
                                                          kv_heads: int, d: int, window: int) -> None:
    # 600 positions of 4 kv heads of 64 floats (600 KiB of values) are more than the kernel prefetches
    # during the score pass (kCachedValueBytes): its values are then prefetched in the value pass
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 600]
    q, k_cache, v_cache, tables, lens_t = decode_case(block_size + d, kv_heads=kv_heads, group=2, d=d,
                                                      dtype=torch.float32, lens=lens, block_size=block_size)
    out = torch.full_like(q, float("nan"))
    kernel(q, k_cache, v_cache, tables, lens_t, d ** -0.5, window, 0.0, out)
    expected = float64_decode_attention(q, k_cache, v_cache, tables, lens_t, scale=d ** -0.5, window=window,
                                        softcap=0.0)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_attention_layer_uses_the_kernel_for_decodes(kernel: Callable[..., None]) -> None:
    """paged_attention_forward with a DecodeBatch: the rows come from the kernel, in the layer's layout."""
    kv_heads, group, d = 2, 2, 32
    lens = [5, 40, 19]
    q, k_cache, v_cache, tables, lens_t = decode_case(1, kv_heads=kv_heads, group=group, d=d,
                                                      dtype=torch.float32, lens=lens)
    calls: list[Any] = []

    def counting_kernel(*args: Any) -> None:
        calls.append(args)
        kernel(*args)

    # this step's K/V for the 3 decode tokens go to the last position of each sequence
    slots = torch.tensor([int(tables[s, (n - 1) // DECODE_BLOCK]) * DECODE_BLOCK + (n - 1) % DECODE_BLOCK
                          for s, n in enumerate(lens)])
    new_k = torch.randn(1, kv_heads, len(lens), d)
    new_v = torch.randn(1, kv_heads, len(lens), d)
    meta = PagedMetadata(kv_caches=[(k_cache, v_cache)], slot_mapping=slots,
                         decode_batch=DecodeBatch(0, len(lens), tables, lens_t, counting_kernel))
    query = q.flatten(1, 2).transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, d] as transformers passes it
    module = torch.nn.Module()
    out, _ = paged_attention_forward(module, query, new_k, new_v, None, scaling=0.5, paged_metadata=meta)
    assert len(calls) == 1
    expected = float64_decode_attention(q, k_cache, v_cache, tables, lens_t, scale=0.5, window=0, softcap=0.0)
    torch.testing.assert_close(out[0].double(), expected.flatten(1, 2), atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache.flatten(0, 1)[slots], new_k[0].transpose(0, 1))  # written before it was read


def test_unavailable_kernel_is_none_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    assert cpu_kernels.load() is None


def test_a_failed_build_falls_back_to_the_torch_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """No working compiler: load() logs why and returns None (the engine keeps its torch path); no lock or
    half-built library is left behind to wedge the next start."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # torch's extension builder runs $CXX: a compiler that always fails
    monkeypatch.delenv(cpu_kernels.DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
    assert "unavailable, using the torch path" in caplog.text
    kernels_dir = tmp_path / "kernels"
    assert not kernels_dir.exists() or list(kernels_dir.iterdir()) == []
