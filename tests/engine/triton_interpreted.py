"""Runs the engine's Triton decode kernel in Triton's interpreter, on the CPU (test_triton_decode.py).

Its own process: TRITON_INTERPRET=1 must be set before triton is imported, and the test session has imported
it long before (transformers does). Usage: triton_interpreted.py IN OUT (torch.save files): IN holds the
kernel cases, OUT gets their outputs, whether `load()` accepts the kernel, refuses a wrong one and obeys
ENGINE_TRITON_DECODE=0, and the greedy tokens of the tiny model's engine on its torch decode path and on the
Triton kernel.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from engine_server.engine import triton_decode
from engine_server.engine.config import EngineConfig
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, SamplingParams
from engine_server.models.tiny import default_model_dir

SHAPE = {"kv_heads": 2, "group": 2, "head_dim": 16, "block_size": 16}  # the tiny model's


def kernel_outputs(cases: list[tuple[Any, ...]]) -> list[torch.Tensor]:
    outs = []
    for q, k_cache, v_cache, tables, lens, scale, window, softcap in cases:
        out = torch.full_like(q, float("nan"))
        triton_decode.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window, softcap, out)
        outs.append(out)
    return outs


def load_checks() -> tuple[bool, bool, bool]:
    """(the kernel passes load()'s check, one off by 1e-2 does not, ENGINE_TRITON_DECODE=0 turns it off)."""
    cpu = torch.device("cpu")
    accepted = triton_decode.load(cpu, torch.float32, **SHAPE) is not None
    os.environ[triton_decode.DISABLE_ENV] = "0"
    try:
        disabled = triton_decode.load(cpu, torch.float32, **SHAPE) is None
    finally:
        del os.environ[triton_decode.DISABLE_ENV]
    real = triton_decode.paged_decode_attention

    def off_by_a_little(*args: Any) -> None:
        real(*args)
        args[-1].add_(1e-2)

    triton_decode.paged_decode_attention = off_by_a_little  # type: ignore[assignment]
    try:
        rejected = triton_decode.load(cpu, torch.float32, **SHAPE) is None
    finally:
        triton_decode.paged_decode_attention = real
    return accepted, rejected, disabled


def greedy_tokens(use_triton: bool) -> list[list[int]]:
    """Greedy completions of the tiny model, decode attention on the torch path or on the Triton kernel."""
    engine = LLMEngine(EngineConfig(model=str(default_model_dir()), num_threads=1))
    assert engine.runner is not None
    assert engine.runner.decode_kernel is None  # ENGINE_CPU_KERNELS=0: the torch path
    if use_triton:
        engine.runner.decode_kernel = triton_decode.paged_decode_attention
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 200, 31], list(range(40, 75)), [7] * 18]  # contexts across 1-3 cache blocks
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", tuple(prompt), params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert os.environ.get("ENGINE_CPU_KERNELS") == "0"
    cases = torch.load(sys.argv[1])
    accepted, rejected, disabled = load_checks()
    result = {"outs": kernel_outputs(cases), "accepted": accepted, "rejected": rejected, "disabled": disabled,
              "greedy_torch": greedy_tokens(use_triton=False),
              "greedy_triton": greedy_tokens(use_triton=True)}
    torch.save(result, sys.argv[2])


if __name__ == "__main__":
    main()
