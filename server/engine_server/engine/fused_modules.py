"""Swaps the forward of a model's RMSNorm and gated-SiLU MLP modules for the fused CPU kernels.

transformers' modeling code stays the model: only modules that look like the two known patterns AND
give the same numbers as their own forward on a probe input at load time are swapped, so a variant
with other semantics (Gemma's (1 + weight) norm, a GELU MLP, float32 norm weights in a bf16 model)
keeps its own forward.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from engine_server.engine.cpu_kernels import CpuKernels

logger = logging.getLogger(__name__)


def fuse_modules(model: torch.nn.Module, kernels: CpuKernels) -> dict[str, int]:
    """Patches the matching modules in place; returns how many of each kind were swapped."""
    counts = {"rms_norm": 0, "silu_mlp": 0}
    for module in model.modules():
        if _looks_like_rms_norm(module):
            kind, fused = "rms_norm", _rms_norm_forward(kernels, module.forward)
        elif _looks_like_silu_mlp(module):
            kind, fused = "silu_mlp", _mlp_forward(kernels)
        else:
            continue
        if _swap(module, types.MethodType(fused, module)):
            counts[kind] += 1
    return counts


def _looks_like_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and isinstance(getattr(module, "variance_epsilon", None), float))


def _looks_like_silu_mlp(module: torch.nn.Module) -> bool:
    linears = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(module, "act_fn", None)
    return (all(isinstance(x, torch.nn.Linear) for x in linears)
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


def _rms_norm_forward(kernels: CpuKernels, own_forward: Any) -> Any:
    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:  # e.g. float32 norm weights kept in a bf16 model
            return own_forward(hidden_states)  # type: ignore[no-any-return]
        x = hidden_states.contiguous()
        out = torch.empty_like(x)
        kernels.rms_norm(x, self.weight, self.variance_epsilon, out)
        return out
    return forward


def _mlp_forward(kernels: CpuKernels) -> Any:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        out = torch.empty_like(gate)
        kernels.silu_and_mul(gate, self.up_proj(x), out)
        down: torch.Tensor = self.down_proj(out)
        return down
    return forward


def _swap(module: torch.nn.Module, fused: Any) -> bool:
    """Installs `fused` as the module's forward if it reproduces the module's own on a probe."""
    param = next(module.parameters())
    width = param.shape[-1] if param.dim() == 1 else int(getattr(module.gate_proj, "in_features", 0))
    probe = torch.randn(3, 5, width, generator=torch.Generator().manual_seed(0)).to(param.dtype) * 2
    # two ulps of the model dtype (1e-5 in float32, where the MLP's down projection sums over many
    # products of values that differ in their last bits): the kernels round where torch rounds, but
    # compute exp and sums in another order. A different formula is off by far more.
    tolerance = max(2 * torch.finfo(param.dtype).eps, 1e-5)
    try:
        with torch.inference_mode():
            expected = module(probe).float()
            got = fused(probe).float()
        scale = float(expected.abs().max())
        same = bool(torch.allclose(got, expected, rtol=tolerance, atol=tolerance * scale))
    except Exception as e:  # e.g. a dtype the kernel does not take: keep the module's own forward
        logger.debug("not fusing %s: %s", type(module).__name__, e)
        return False
    if not same:
        logger.info("not fusing %s: its forward differs from the fused kernel's", type(module).__name__)
        return False
    module.forward = fused
    return True
