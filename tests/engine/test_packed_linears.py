"""Linears on packed oneDNN weights (packed_linears.py): the same numbers, fused siblings, what is kept."""

from __future__ import annotations

import pytest
import torch
from engine_server.engine import packed_linears
from engine_server.engine.cpu_kernels import CpuKernels
from engine_server.engine.fused_modules import fuse_modules
from engine_server.engine.packed_linears import PackedLinear, SharedInput, pack_linears
from engine_testutil import KERNEL_VARIANTS, cpu_kernel_variant
from test_fused_modules import GatedMLP, SiLUActivation

DTYPES = [d for d in (torch.float32, torch.bfloat16) if packed_linears.available(d)]
if not DTYPES:
    pytest.skip("this torch or CPU runs no packed oneDNN linears", allow_module_level=True)


@pytest.fixture(scope="module", params=KERNEL_VARIANTS)
def kernels(request: pytest.FixtureRequest) -> CpuKernels:
    loaded: CpuKernels = cpu_kernel_variant(request.param)
    return loaded


class Attention(torch.nn.Module):
    """q, k and v of one input, as transformers' attention layers call them."""

    def __init__(self, hidden: int, kv: int, *, bias: bool) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = torch.nn.Linear(hidden, kv, bias=bias)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=bias)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        out: torch.Tensor = self.o_proj(q * k.sum(-1, keepdim=True).sigmoid()) + v.mean(-1, keepdim=True)
        return out


class ScaledLinear(torch.nn.Linear):  # a forward other than x @ W.T + b: must keep it
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def _model(dtype: torch.dtype) -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    embed = torch.nn.Embedding(96, 64)
    tied = torch.nn.Linear(64, 96, bias=False)
    tied.weight = embed.weight
    return torch.nn.ModuleDict({
        "attn": Attention(64, 32, bias=False), "attn_bias": Attention(64, 16, bias=True),
        "mlp": GatedMLP(64, 176, SiLUActivation()), "head": torch.nn.Linear(64, 96, bias=True),
        "scaled": ScaledLinear(64, 64), "embed": embed, "tied": tied,
    }).to(dtype)


def _outputs(model: torch.nn.ModuleDict, x: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        return {name: module(x) for name, module in model.items() if name != "embed"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_rows_matches_torch(kernels: CpuKernels, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    gate_up = (torch.randn(3, 5, 2 * 1001) * 6).to(dtype)  # 1001: not a multiple of 8 or 16
    gate_up[0, 0, :3] = torch.tensor([-200.0, 200.0, 0.0])
    out = gate_up.new_empty((3, 5, 1001))
    kernels.silu_and_mul_rows(gate_up, out)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(out, expected, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    with pytest.raises(RuntimeError, match="silu_and_mul_rows"):
        kernels.silu_and_mul_rows(gate_up, gate_up.new_empty((3, 5, 1000)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_linear_is_packed_and_gives_the_same_numbers(kernels: CpuKernels, dtype: torch.dtype) -> None:
    model = _model(dtype)
    x = torch.randn(2, 9, 64).to(dtype)
    before = _outputs(model, x)
    fuse_modules(model, kernels)
    assert pack_linears(model, kernels) == {"qkv": 2, "mlp": 1, "linear": 4}  # o_proj x2, head, tied
    after = _outputs(model, x)
    ulp = torch.finfo(dtype).eps
    for name, expected in before.items():
        scale = float(expected.abs().max())
        torch.testing.assert_close(after[name], expected, rtol=4 * ulp, atol=4 * ulp * scale)
    assert "forward" not in vars(model["scaled"])  # its own forward: not x @ W.T + b
    # the originals of packed weights are freed; a weight the embedding shares is kept
    weights: dict[str, torch.Tensor] = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    assert weights["attn.q_proj.weight"].numel() == 0
    assert weights["mlp.down_proj.weight"].numel() == 0
    assert weights["head.weight"].numel() == 0
    assert weights["head.weight"].dtype == dtype
    assert weights["tied.weight"].numel() == 96 * 64
    assert weights["tied.weight"] is weights["embed.weight"]
    assert weights["scaled.weight"].numel() == 64 * 64


def test_without_the_kernels_the_mlp_linears_are_packed_one_by_one() -> None:
    model = _model(torch.float32)
    x = torch.randn(3, 64)
    before = _outputs(model, x)
    assert pack_linears(model, None) == {"qkv": 2, "mlp": 0, "linear": 7}
    for name, got in _outputs(model, x).items():
        torch.testing.assert_close(got, before[name], rtol=1e-5, atol=1e-5)


def test_siblings_share_one_gemm_and_nothing_is_held_after() -> None:
    weights = [torch.randn(n, 32) for n in (32, 16, 8)]
    packed = PackedLinear(weights, [None, None, None])
    calls: list[torch.Tensor] = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return packed(x)

    shared = SharedInput(counted, [32, 16, 8])
    x, y = torch.randn(5, 32), torch.randn(5, 32)
    parts = [shared.part(i, x) for i in (0, 1, 2)]
    assert len(calls) == 1
    for part, weight in zip(parts, weights, strict=True):
        torch.testing.assert_close(part, x @ weight.T, rtol=1e-5, atol=1e-5)
    assert shared._input is None  # all handed out: nothing kept
    assert shared._output is None
    # another input, or a part asked twice of one input, computes anew
    torch.testing.assert_close(shared.part(1, y), y @ weights[1].T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared.part(1, y), y @ weights[1].T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared.part(2, x), x @ weights[2].T, rtol=1e-5, atol=1e-5)
    assert len(calls) == 4


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(packed_linears.DISABLE_ENV, "0")
    assert not packed_linears.available(torch.float32)
    monkeypatch.setenv(packed_linears.DISABLE_ENV, "1")
    assert packed_linears.available(torch.float32)
    assert not packed_linears.available(torch.float16)
