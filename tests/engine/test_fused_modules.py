"""The fused RMSNorm / SiLU-and-mul / rotary kernels, and what fuse_modules swaps (and what it leaves)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from engine_server.engine.cpu_kernels import CpuKernels
from engine_server.engine.fused_modules import FusedRotary, fuse_modules, rotary_kernel_active
from engine_testutil import KERNEL_VARIANTS, cpu_kernel_variant
from transformers.models.llama import modeling_llama

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", params=KERNEL_VARIANTS)
def kernels(request: pytest.FixtureRequest) -> CpuKernels:
    loaded: CpuKernels = cpu_kernel_variant(request.param)
    return loaded


class LlamaRMSNorm(torch.nn.Module):  # transformers' formula, under the class name the swap looks for
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(LlamaRMSNorm):  # (1 + weight): must not be swapped
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x * (1.0 + self.weight.float())).to(hidden_states.dtype)


class SiLUActivation(torch.nn.SiLU):
    pass


class GELUActivation(torch.nn.GELU):
    pass


class GatedMLP(torch.nn.Module):
    def __init__(self, hidden: int, inter: int, act: torch.nn.Module) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 68, 72, 512])  # 68: partial last 8 and 16 lanes; 72: last 16
def test_rms_norm_matches_the_torch_formula(kernels: CpuKernels, dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(hidden)
    norm = LlamaRMSNorm(hidden).to(dtype)
    x = (torch.randn(33, hidden) * 3).to(dtype)
    out = torch.empty_like(x)
    with torch.inference_mode():
        kernels.rms_norm(x, norm.weight, norm.variance_epsilon, out)
        expected = norm(x)
    # the normalized value is rounded to the dtype before the weight, as torch does: all but a few
    # elements on a rounding boundary agree to the bit
    if dtype != torch.float32:
        assert (out == expected).float().mean() > 0.98
    torch.testing.assert_close(out, expected, rtol=2 * torch.finfo(dtype).eps, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(kernels: CpuKernels, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    gate = (torch.randn(7, 1001) * 6).to(dtype)  # 7007: not a multiple of 8 or 16; large |x| saturates exp
    gate[0, :3] = torch.tensor([-200.0, 200.0, 0.0])
    up = torch.randn(7, 1001).to(dtype)
    out = torch.empty_like(gate)
    kernels.silu_and_mul(gate, up, out)
    expected = torch.nn.functional.silu(gate) * up
    if dtype != torch.float32:
        assert (out == expected).float().mean() > 0.98
    torch.testing.assert_close(out, expected, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


def test_only_modules_with_the_same_numbers_are_swapped(kernels: CpuKernels) -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "norm": LlamaRMSNorm(64), "gemma_norm": GemmaRMSNorm(64),
        "mlp": GatedMLP(64, 160, SiLUActivation()), "gelu_mlp": GatedMLP(64, 160, GELUActivation()),
    }).to(torch.bfloat16)
    x = torch.randn(2, 9, 64).to(torch.bfloat16)
    with torch.inference_mode():
        before = {name: module(x) for name, module in model.items()}
    assert fuse_modules(model, kernels) == {"rms_norm": 1, "silu_mlp": 1, "rotary": 0}
    assert "forward" in vars(model["norm"])
    assert "forward" in vars(model["mlp"])
    assert "forward" not in vars(model["gemma_norm"])
    assert "forward" not in vars(model["gelu_mlp"])
    with torch.inference_mode():
        for name, module in model.items():
            torch.testing.assert_close(module(x), before[name], rtol=2e-2, atol=2e-2)


def test_a_norm_with_float32_weights_in_a_bf16_model_runs_its_own_forward(kernels: CpuKernels) -> None:
    """transformers keeps some norms in float32 in a bf16 model: the kernel takes one dtype, so those
    calls go to the module's own forward instead of failing."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(64)  # float32 weight
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.inference_mode():
        expected = norm(x)
        assert fuse_modules(torch.nn.ModuleDict({"norm": norm}), kernels)["rms_norm"] == 1
        assert torch.equal(norm(x), expected)


def _transformers_rotary() -> Any:
    """transformers' own apply_rotary_pos_emb (an engine made earlier in this process may have put FusedRotary
    in its place)."""
    function = modeling_llama.apply_rotary_pos_emb
    return function.original if isinstance(function, FusedRotary) else function


def _rotary_inputs(dtype: torch.dtype, d: int, *, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # transformers' layout: the projections [b, t, heads, d] viewed as [b, heads, t, d]
    q = (torch.randn(2, 7, 3, d, generator=gen) * 3).to(dtype).transpose(1, 2)
    k = (torch.randn(2, 7, 1, d, generator=gen) * 3).to(dtype).transpose(1, 2)
    angles = torch.rand(2, 7, d // 2, generator=gen) * 100
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [6, 16, 128])  # 6: a half of 3 lanes
def test_rotary_kernel_matches_transformers(kernels: CpuKernels, dtype: torch.dtype, d: int) -> None:
    q, k, cos, sin = _rotary_inputs(dtype, d, seed=d)
    expected = _transformers_rotary()(q, k, cos, sin)
    for q_in, k_in in ((q, k), (q.contiguous(), k.contiguous())):  # also [b, heads, t, d] laid out as such
        q_out, k_out = torch.full_like(q_in, float("nan")), torch.full_like(k_in, float("nan"))
        kernels.rotary_embedding(q_in, k_in, cos, sin, q_out, k_out)
        for got, want in ((q_out, expected[0]), (k_out, expected[1])):
            # products rounded to the dtype, then the sum, as torch does: to the bit but for FMA contraction
            torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


def test_rotary_kernel_refuses_what_it_cannot_rotate(kernels: CpuKernels) -> None:
    q, k, cos, sin = _rotary_inputs(torch.float32, 16, seed=0)
    out_q, out_k = torch.empty_like(q), torch.empty_like(k)
    with pytest.raises(RuntimeError, match="cos and sin must be"):  # partial rotary: cos covers 8 of 16 dims
        kernels.rotary_embedding(q, k, cos[..., :8], sin[..., :8], out_q, out_k)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.rotary_embedding(q, k, cos.double(), sin.double(), out_q, out_k)
    with pytest.raises(RuntimeError, match="unit stride"):
        kernels.rotary_embedding(q.transpose(2, 3), k, cos, sin, out_q.transpose(2, 3), out_k)


class _CountingKernels:
    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels, self.calls = kernels, 0

    def rotary_embedding(self, *args: Any) -> None:
        self.calls += 1
        self.kernels.rotary_embedding(*args)


def _modeling_file(monkeypatch: pytest.MonkeyPatch, name: str, rotary: Any) -> torch.nn.ModuleDict:
    """A stand-in for a transformers modeling file with one attention class whose forward looks the rotary
    function up as a global at each call, as transformers' do; returns a model made of that class."""
    modeling = types.ModuleType(name)
    modeling.apply_rotary_pos_emb = rotary  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, modeling)

    class Attention(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            result: tuple[torch.Tensor, torch.Tensor] = sys.modules[name].apply_rotary_pos_emb(q, k, cos, sin)
            return result

    Attention.__module__ = name
    return torch.nn.ModuleDict({"attn": Attention()})


def test_rotary_is_fused_per_modeling_file_and_used_only_in_the_engines_passes(
        kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    original = _transformers_rotary()
    model = _modeling_file(monkeypatch, "fake_modeling_rotary", original)
    assert fuse_modules(model, kernels)["rotary"] == 1
    fused = sys.modules["fake_modeling_rotary"].apply_rotary_pos_emb
    assert isinstance(fused, FusedRotary)
    assert fused.original is original
    assert fuse_modules(model, kernels)["rotary"] == 1  # already fused: counted, not wrapped twice
    assert sys.modules["fake_modeling_rotary"].apply_rotary_pos_emb is fused
    q, k, cos, sin = _rotary_inputs(torch.float32, 16, seed=1)
    expected = original(q, k, cos, sin)
    counting = _CountingKernels(kernels)
    outside = model["attn"](q, k, cos, sin)  # e.g. a reference model in the same process: the original's code
    with rotary_kernel_active(counting):  # type: ignore[arg-type]
        inside = model["attn"](q, k, cos, sin)
        assert counting.calls == 1
        # float64 angles for float32 q and k (torch promotes) are not the kernel's: the original's numbers
        promoted = model["attn"](q, k, cos.double(), sin.double())
        assert counting.calls == 2  # tried, refused before writing anything
    assert counting.calls == 2
    for got in (outside, inside):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(promoted, original(q, k, cos.double(), sin.double()),
                                                  strict=True))


def test_a_different_rotary_function_is_not_replaced(kernels: CpuKernels,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-J-style rotary (pairs of adjacent dims, not the two halves) has other numbers: it stays."""
    def interleaved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def rotate(x: torch.Tensor) -> torch.Tensor:
            pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
            return x * cos.unsqueeze(1) + pairs * sin.unsqueeze(1)
        return rotate(q), rotate(k)

    model = _modeling_file(monkeypatch, "fake_modeling_interleaved", interleaved)
    assert fuse_modules(model, kernels)["rotary"] == 0
    assert sys.modules["fake_modeling_interleaved"].apply_rotary_pos_emb is interleaved
