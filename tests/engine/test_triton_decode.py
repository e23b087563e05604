"""The CUDA engine's decode attention kernel (engine/triton_decode.py) checked on the CPU, in Triton's
interpreter (a process of its own: triton_interpreted.py): against attention computed in float64 on the
cases the CPU kernel is tested on, `load()`'s self-check (it takes the kernel and refuses a wrong one), and
the tiny model's greedy tokens with decode attention on the kernel vs on the torch path.

On a GPU (`ENGINE_TEST_DEVICE=cuda`) the engine tests run the compiled kernel itself (ModelRunner picks it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testutil import DECODE_CASES, DECODE_DTYPES, DECODE_LENS, decode_case, float64_decode_attention

pytest.importorskip("triton")

CASES = [(dtype, tolerance, *case) for dtype, tolerance in DECODE_DTYPES for case in DECODE_CASES]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("triton")
    inputs = []
    for dtype, _, kv_heads, group, d, window, softcap in CASES:
        q, k_cache, v_cache, tables, lens = decode_case(d + group, kv_heads=kv_heads, group=group, d=d,
                                                        dtype=dtype, lens=DECODE_LENS)
        inputs.append((q, k_cache, v_cache, tables, lens, d ** -0.5, window, softcap))
    torch.save(inputs, folder / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "ENGINE_CPU_KERNELS": "0"}
    runner = Path(__file__).with_name("triton_interpreted.py")
    subprocess.run([sys.executable, str(runner), str(folder / "in.pt"), str(folder / "out.pt")], env=env,
                   check=True, timeout=900)
    result: dict[str, Any] = torch.load(folder / "out.pt")
    result["inputs"] = inputs
    return result


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_float64_attention(interpreted: dict[str, Any], case: int) -> None:
    q, k_cache, v_cache, tables, lens, scale, window, softcap = interpreted["inputs"][case]
    tolerance = CASES[case][1]
    expected = float64_decode_attention(q, k_cache, v_cache, tables, lens, scale=scale, window=window,
                                        softcap=softcap)
    torch.testing.assert_close(interpreted["outs"][case].double(), expected, atol=tolerance, rtol=tolerance)


def test_load_checks_the_kernel_before_the_engine_takes_it(interpreted: dict[str, Any]) -> None:
    assert interpreted["accepted"], "load() refused a kernel that matches torch"
    assert interpreted["rejected"], "load() took a kernel whose outputs are off by 1e-2"
    assert interpreted["disabled"], "load() gave the kernel with ENGINE_TRITON_DECODE=0"


def test_engine_greedy_tokens_on_the_kernel(interpreted: dict[str, Any]) -> None:
    torch_path, kernel_path = interpreted["greedy_torch"], interpreted["greedy_triton"]
    assert [len(tokens) for tokens in torch_path] == [6, 6, 6]
    assert kernel_path == torch_path
