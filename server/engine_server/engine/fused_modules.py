"""Swaps the forward of a model's RMSNorm and gated-SiLU MLP modules, and its modeling file's rotary
embedding function, for the fused CPU kernels.

transformers' modeling code stays the model: only modules that look like the two known patterns AND
give the same numbers as their own forward on a probe input at load time are swapped, so a variant
with other semantics (Gemma's (1 + weight) norm, a GELU MLP, float32 norm weights in a bf16 model)
keeps its own forward. Likewise `apply_rotary_pos_emb` (~14 small torch ops per layer: ~200 us of a
decode step's layer at 256 sequences on a 2-vCPU machine, ~800 us in a 2048-token prefill) is replaced
only where the kernel reproduces the original on a probe. The replacement is a module global, so it is
seen by every model of that architecture in the process: it calls the kernel only inside the engine's own
forward passes (`rotary_kernel_active`), and hands every other call, and every call the kernel does not
take (partial rotary, other devices, other arguments), to the original.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from engine_server.engine.cpu_kernels import CpuKernels

logger = logging.getLogger(__name__)


_ACTIVE_ROTARY: ContextVar[Callable[..., None] | None] = ContextVar("engine_active_rotary", default=None)


@contextmanager
def rotary_kernel_active(kernels: CpuKernels) -> Iterator[None]:
    """Within this block (a forward pass of the engine's model), FusedRotary calls the kernel."""
    token = _ACTIVE_ROTARY.set(kernels.rotary_embedding)
    try:
        yield
    finally:
        _ACTIVE_ROTARY.reset(token)


def fuse_modules(model: torch.nn.Module, kernels: CpuKernels) -> dict[str, int]:
    """Patches the matching modules in place; returns how many of each kind were swapped ("rotary": the
    modeling files of the model's modules whose `apply_rotary_pos_emb` is now, or was already, fused)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    counts = {"rms_norm": 0, "silu_mlp": 0, "rotary": 0}
    for modeling in dict.fromkeys(type(module).__module__ for module in model.modules()):
        counts["rotary"] += _fuse_rotary(modeling, dtype, kernels)
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
    forward.engine_silu_mlp = True  # type: ignore[attr-defined]  # (packed_linears.py fuses gate and up)
    return forward


class FusedRotary:
    """Stands in for a modeling file's `apply_rotary_pos_emb(q, k, cos, sin)` (transformers looks the
    global up at each call): the kernel inside `rotary_kernel_active`, the original anywhere else."""

    def __init__(self, original: Any) -> None:
        self.original = original

    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rotate = _ACTIVE_ROTARY.get()
        if rotate is not None and not args and not kwargs and q.is_cpu and q.dim() == 4 and cos.dim() == 3:
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)
            try:
                rotate(q, k, cos, sin, q_out, k_out)
                return q_out, k_out
            except RuntimeError:  # partial rotary, another layout or dtype (checked before any write)
                pass
        result: tuple[torch.Tensor, torch.Tensor] = self.original(q, k, cos, sin, *args, **kwargs)
        return result


def _fuse_rotary(modeling_name: str, dtype: torch.dtype, kernels: CpuKernels) -> bool:
    """Replaces `apply_rotary_pos_emb` in a modeling file if it has one and the kernel reproduces it; True
    where it is replaced (now or before)."""
    modeling = sys.modules.get(modeling_name)
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    if isinstance(original, FusedRotary):
        return True
    if original is None or not callable(original):
        return False
    gen = torch.Generator().manual_seed(0)
    # the layout attention layers pass: projections [b, t, heads, d] viewed as [b, heads, t, d]
    q = torch.randn(2, 5, 3, 16, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(2, 5, 1, 16, generator=gen).to(dtype).transpose(1, 2)
    angles = torch.rand(2, 5, 8, generator=gen) * 6
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    try:
        with torch.inference_mode():
            expected = original(q, k, cos, sin)
            got = torch.empty_like(q), torch.empty_like(k)
            kernels.rotary_embedding(q, k, cos, sin, *got)
        eps = torch.finfo(dtype).eps  # two ulps (|values| < 4 here)
        same = all(torch.allclose(g.float(), e.float(), rtol=2 * eps, atol=8 * eps)
                   for g, e in zip(got, expected, strict=True))
    except Exception as e:  # another signature, a dtype the kernel does not take: keep the original
        logger.debug("not fusing %s.apply_rotary_pos_emb: %s", modeling_name, e)
        return False
    if not same:
        logger.info("not fusing %s.apply_rotary_pos_emb: it differs from the kernel's", modeling_name)
        return False
    setattr(modeling, "apply_rotary_pos_emb", FusedRotary(original))  # noqa: B010 (a module's global)
    return True


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
