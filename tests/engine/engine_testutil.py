"""Drives an LLMEngine to completion and computes reference outputs with transformers."""

from __future__ import annotations

import functools
import os
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from engine_server.engine.config import EngineConfig
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import CompletionDelta, EngineRequest, FinishReason, SamplingParams

# The engine tests run on the CPU; `ENGINE_TEST_DEVICE=cuda` runs the same tests (engines and references) on a
# GPU where one is lent (the CUDA path: the Triton decode kernel instead of the CPU one, or padded SDPA decode
# groups where Triton is missing).
DEVICE = os.environ.get("ENGINE_TEST_DEVICE", "cpu")


def engine_config(model_dir: Path | str, **kwargs: Any) -> EngineConfig:
    """An EngineConfig for the test device."""
    return EngineConfig(model=str(model_dir), device=DEVICE, **kwargs)


class Collected:
    """Every delta of a run, folded per (request_id, index)."""

    def __init__(self) -> None:
        self.tokens: dict[tuple[str, int], list[int]] = defaultdict(list)
        self.finish: dict[tuple[str, int], FinishReason] = {}
        self.deltas: list[CompletionDelta] = []

    def add(self, deltas: list[CompletionDelta]) -> None:
        seen = set()
        for d in deltas:
            key = (d.request_id, d.index)
            assert key not in seen, "more than one delta for a completion in one step"
            seen.add(key)
            assert key not in self.finish, "delta after the completion finished"
            self.deltas.append(d)
            self.tokens[key].extend(d.new_token_ids)
            if d.finish_reason is not None:
                self.finish[key] = d.finish_reason


def run(engine: LLMEngine, requests: list[EngineRequest], *, per_step: int | None = None,
        max_steps: int = 100_000) -> Collected:
    """Adds requests (all at once, or per_step of them before each step) and steps until idle."""
    out = Collected()
    pending = list(requests)
    for _ in range(max_steps):
        take = len(pending) if per_step is None else per_step
        for request in pending[:take]:
            engine.add_request(request)
        pending = pending[take:]
        out.add(engine.step())
        if not pending and not engine.has_unfinished():
            return out
    raise AssertionError("engine did not finish")


@torch.inference_mode()
def reference_greedy(model: Any, prompts: list[list[int]], max_tokens: list[int],
                     eos_id: int) -> list[list[int]]:
    """model.generate(do_sample=False) per request; requests with equal prompt lengths share a batch
    (no padding, so each row is what the request alone would produce), then each row is cut at its
    own max_tokens and first EOS."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        by_len[len(prompt)].append(i)
    out: list[list[int]] = [[] for _ in prompts]
    for length, rows in by_len.items():
        ids = torch.tensor([prompts[i] for i in rows], device=model.device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max(max_tokens[i] for i in rows), pad_token_id=2)
        for row, i in enumerate(rows):
            tokens = gen[row, length:length + max_tokens[i]].tolist()
            if eos_id in tokens:
                tokens = tokens[:tokens.index(eos_id) + 1]
            out[i] = tokens
    return out


def assert_greedy_like_transformers(engine: LLMEngine, ref_model: Any, lengths: tuple[int, ...], *, seed: int,
                                    max_tokens: int) -> None:
    """Random prompts of these lengths, decoded greedily by the engine (all added at once): each request's
    tokens are what transformers' generate gives."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(length)] for length in lengths]
    requests = [EngineRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0, max_tokens=max_tokens))
                for i, p in enumerate(prompts)]
    got = run(engine, requests)
    want = reference_greedy(ref_model, prompts, [max_tokens] * len(prompts), eos_id=1)
    for i, expected in enumerate(want):
        assert got.tokens[(f"r{i}", 0)] == expected, f"request r{i}"


KERNEL_VARIANTS = ("native", "no-avx512", "portable")
# variant -> (module name, extra compiler flags): the code CPUs without AVX-512 run (AVX2 where the CPU has
# it), and the portable C++ of CPUs without AVX2
_VARIANT_BUILDS = {
    "no-avx512": ("engine_cpu_kernels_no_avx512", ("-mno-avx512f",)),
    "portable": ("engine_cpu_kernels_portable", ("-mno-avx512f", "-mno-avx2")),
}


@functools.cache
def cpu_kernel_variant(variant: str) -> Any:
    """The engine's CPU kernels as the engine builds them ("native": AVX-512 or AVX2 where the CPU has it),
    or built for a lesser CPU (_VARIANT_BUILDS), so every implementation this CPU can run gets checked."""
    import pytest
    from engine_server.engine import cpu_kernels

    if os.environ.get(cpu_kernels.DISABLE_ENV) == "0":
        pytest.skip(f"{cpu_kernels.DISABLE_ENV}=0: the kernels are switched off")
    kernels = cpu_kernels.load() if variant == "native" else cpu_kernels._load(*_VARIANT_BUILDS[variant])
    assert kernels is not None, "the engine's CPU kernels did not build (see the log for why)"
    flags = f"{open('/proc/cpuinfo').read()} ".replace("\n", " ")  # noqa: SIM115
    has_avx2 = all(f" {flag} " in flags for flag in ("avx2", "fma", "f16c"))
    if variant == "portable":
        assert kernels.isa() == "portable"
    elif variant == "no-avx512":
        assert kernels.isa() == ("avx2" if has_avx2 else "portable")
    elif " avx512f " in flags:
        assert kernels.isa() == "avx512"
    elif has_avx2:
        assert kernels.isa() == "avx2"
    return kernels


# Decode attention over a paged cache (the CPU kernel's tests and the Triton kernel's share these)
DECODE_BLOCK = 16
DECODE_NUM_BLOCKS = 64
DECODE_LENS = [1, 2, 15, 16, 17, 33, 100, 250, 7]
DECODE_CASES = [
    # kv_heads, group, d, window, softcap
    (4, 2, 64, 0, 0.0),
    (1, 8, 64, 0, 0.0),
    (3, 1, 80, 0, 0.0),  # 80 = 5 x 16: no tail; 40 below has a masked tail
    (2, 2, 40, 0, 0.0),
    (2, 2, 20, 0, 0.0),  # 20: a tail in 8-lane (AVX2) chunks too
    (2, 2, 16, 7, 0.0),  # the tiny model's head size, a window that is not a multiple of 8
    (2, 3, 64, 20, 0.0),
    (2, 2, 64, 0, 30.0),
]
DECODE_DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]


def decode_case(seed: int, *, kv_heads: int, group: int, d: int, dtype: torch.dtype,
                lens: list[int], block_size: int = DECODE_BLOCK) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, block tables, context lengths): random, the blocks scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(DECODE_NUM_BLOCKS, sum(-(-n // block_size) for n in lens) + 1)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    q = torch.randn(len(lens), kv_heads, group, d, generator=gen).to(dtype)
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)  # scattered, like a cache after many requests
    max_blocks = -(-max(lens) // block_size)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    for i, n in enumerate(lens):
        for b in range(-(-n // block_size)):
            tables[i, b] = free.pop()
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.long)


def float64_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             tables: torch.Tensor, lens: torch.Tensor, *, scale: float, window: int,
                             softcap: float) -> torch.Tensor:
    """Decode attention computed directly in float64, one sequence at a time (the kernels' yardstick)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group, block_size = q.shape[2], k_cache.shape[1]
    for s, n in enumerate(lens.tolist()):
        positions = torch.arange(n)
        slots = tables[s, positions // block_size] * block_size + positions % block_size
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [n, heads, d]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        qs = q[s].double().flatten(0, 1)  # [heads, d]
        scores = torch.einsum("hd,nhd->hn", qs, k) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        if window > 0:
            scores[:, positions < n - window] = float("-inf")
        out[s] = (torch.softmax(scores, dim=-1).unsqueeze(-1) * v.transpose(0, 1)).sum(1).view(q.shape[1:])
    return out
