"""The fused RMSNorm / SiLU-and-mul kernels, and which modules fuse_modules swaps (and which it leaves)."""

from __future__ import annotations

import pytest
import torch
from engine_server.engine.cpu_kernels import CpuKernels
from engine_server.engine.fused_modules import fuse_modules
from engine_testutil import KERNEL_VARIANTS, cpu_kernel_variant

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
    assert fuse_modules(model, kernels) == {"rms_norm": 1, "silu_mlp": 1}
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
