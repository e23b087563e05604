"""The model's linear layers on oneDNN, each weight reordered once at load into oneDNN's blocked layout (CPU).

Why: transformers' modules call `F.linear`, which on a CPU runs MKL's sgemm in float32 (MKL keeps to its
AVX2 code on AMD CPUs) and, in bfloat16, oneDNN with the weight reordered into its blocked layout on every
call. A decode step of the 30M benchmark model is ~95% linears. Here each linear's weight is reordered once
(`mkldnn._reorder_linear_weight`) and every call runs oneDNN's GEMM on it (`mkldnn._linear_pointwise`, the
ops torch.compile's CPU backend packs weights with); and the projections that read one input are one GEMM:
attention's q, k and v (three calls on the same hidden states: the first computes all three, the others take
their columns) and a gated MLP's gate and up (whose output `silu_and_mul_rows` reads directly).
bench/vllm_peer.py's `-unpacked` engine modes measure the engine without it, beside vLLM's CPU engine.

Like fused_modules.py, nothing changes where the result would differ: a module is switched only if its
packed forward reproduces its own on a probe input (to float rounding), and ENGINE_PACKED_LINEARS=0 turns it
all off. A packed weight's original is freed unless another parameter shares its storage (tied embeddings).
"""

from __future__ import annotations

import itertools
import logging
import os
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine_server.engine.cpu_kernels import CpuKernels
from engine_server.engine.lora.context import active_lora

logger = logging.getLogger(__name__)

DISABLE_ENV = "ENGINE_PACKED_LINEARS"
# The rows a step's GEMMs most often have (a decode batch): oneDNN picks the packed layout for it; any other
# number of rows gives the same results.
ROWS_HINT = 64
QKV = ("q_proj", "k_proj", "v_proj")


def available(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU can run the model's linears packed in `dtype`."""
    if os.environ.get(DISABLE_ENV, "1") == "0" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:  # only where the CPU has bf16 instructions: else oneDNN emulates them slowly
        return bool(ops._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear:
    """x @ W.T + b, with W (one weight, or several stacked by rows) reordered once."""

    __slots__ = ("bias", "weight")

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> None:
        weight = weights[0] if len(weights) == 1 else torch.cat(list(weights))
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return out


class SharedInput:
    """Sibling projections of one input as one GEMM: the first part asked of an input computes every part;
    each part is then handed out once, and nothing is held once all are (so nothing stays between steps)."""

    __slots__ = ("_bounds", "_input", "_output", "_packed", "_untaken")

    def __init__(self, packed: Callable[[torch.Tensor], torch.Tensor], widths: Sequence[int]) -> None:
        self._packed = packed
        ends = list(itertools.accumulate(widths))
        self._bounds = [(end - width, end) for end, width in zip(ends, widths, strict=True)]
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._untaken = 0  # bit i: part i of the held output not handed out yet

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x or not (self._untaken >> index) & 1:
            self._input, self._output = x, self._packed(x)
            self._untaken = (1 << len(self._bounds)) - 1
        assert self._output is not None
        start, end = self._bounds[index]
        out = self._output[..., start:end]
        self._untaken &= ~(1 << index)
        if not self._untaken:
            self._input = self._output = None
        return out


def pack_linears(model: torch.nn.Module, kernels: CpuKernels | None) -> dict[str, int]:
    """Switches the model's linears to packed GEMMs where they reproduce the originals; returns how many
    modules of each kind were switched ("qkv": attention layers, "mlp": gated MLPs, "linear": the rest)."""
    counts = {"qkv": 0, "mlp": 0, "linear": 0}
    packed: list[torch.nn.Linear] = []
    with torch.no_grad():  # the probes
        for module in list(model.modules()):
            if (linears := _qkv(module)) and _pack_qkv(module, linears):
                counts["qkv"] += 1
                packed += linears
            elif kernels and (linears := _gated_mlp(module)) and _pack_mlp(module, linears, kernels):
                counts["mlp"] += 1
                packed += linears
        done = {id(linear) for linear in packed}
        for module in list(model.modules()):
            if isinstance(module, torch.nn.Linear) and id(module) not in done and _pack_one(module):
                counts["linear"] += 1
                packed.append(module)
    _release_originals(model, packed)
    return counts


def _children(module: torch.nn.Module, names: Sequence[str]) -> list[torch.nn.Linear]:
    """The module's linears of these names, or [] where one is missing or not a plain linear."""
    linears = [x for name in names if isinstance(x := getattr(module, name, None), torch.nn.Linear)]
    return linears if len(linears) == len(names) else []


def _qkv(module: torch.nn.Module) -> list[torch.nn.Linear]:
    linears = _children(module, QKV)
    if linears and len({(x.in_features, x.bias is None, x.weight.dtype) for x in linears}) == 1:
        return linears
    return []


def _gated_mlp(module: torch.nn.Module) -> list[torch.nn.Linear]:
    """gate, up and down of a module whose forward fused_modules.py installed (T(silu(gate(x))) * up(x), then
    down); [] for any other."""
    if not getattr(getattr(module.forward, "__func__", None), "engine_silu_mlp", False):
        return []
    linears = _children(module, ("gate_proj", "up_proj", "down_proj"))
    if not linears or any(x.bias is not None for x in linears[:2]):
        return []
    if linears[0].weight.dtype != linears[1].weight.dtype:
        return []
    return linears


def _pack_qkv(attention: torch.nn.Module, linears: list[torch.nn.Linear]) -> bool:
    shared = SharedInput(PackedLinear([x.weight for x in linears], [x.bias for x in linears]),
                         [x.out_features for x in linears])
    forwards = [_part_forward(shared, i) for i in range(len(linears))]
    probe = _probe(linears[0].in_features, linears[0].weight.dtype)
    if not all(_same(fwd(probe), linear(probe)) for fwd, linear in zip(forwards, linears, strict=True)):
        logger.info("not packing %s's q/k/v: the packed GEMM differs from the modules' own",
                    type(attention).__name__)
        return False
    for linear, forward in zip(linears, forwards, strict=True):
        _set_forward(linear, forward)
    return True


def _part_forward(shared: SharedInput, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return shared.part(index, x)
    return forward


def _pack_mlp(mlp: torch.nn.Module, linears: list[torch.nn.Linear], kernels: CpuKernels) -> bool:
    gate, up, down = linears
    gate_up = PackedLinear([gate.weight, up.weight], [None, None])
    down_packed = PackedLinear([down.weight], [down.bias])
    width = gate.out_features

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        both = gate_up(x)
        # NOTE: the linears' own forwards are bypassed here, so their LoRA updates are added here (lora/):
        # gate's and up's into their columns before the activation, down's after its GEMM
        lora = active_lora()
        if lora is not None:
            lora.apply(gate, x, both[..., :width])
            lora.apply(up, x, both[..., width:])
        out = both.new_empty((*both.shape[:-1], width))
        kernels.silu_and_mul_rows(both, out)
        down_out = down_packed(out)
        if lora is not None:
            lora.apply(down, out, down_out)
        return down_out

    fused = types.MethodType(forward, mlp)
    probe = _probe(gate.in_features, gate.weight.dtype)
    if not _same(fused(probe), mlp(probe)):
        logger.info("not packing %s: the packed GEMMs differ from its own forward", type(mlp).__name__)
        return False
    _set_forward(mlp, fused)
    return True


def _pack_one(linear: torch.nn.Linear) -> bool:
    if linear.weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    packed = PackedLinear([linear.weight], [linear.bias])
    probe = _probe(linear.in_features, linear.weight.dtype)
    if not _same(packed(probe), linear(probe)):
        logger.info("not packing a %s: the packed GEMM differs from its own", type(linear).__name__)
        return False
    _set_forward(linear, packed)
    return True


def _set_forward(module: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
    # (an instance attribute: nn.Module.__call__ finds it before the class's forward; fused_modules.py too)
    vars(module)["forward"] = forward


def _probe(width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, 7, width, generator=torch.Generator().manual_seed(0)).to(dtype)


def _same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to the rounding of another summation order (a dot product of n float32 terms may differ by
    ~sqrt(n) ulps of its terms' magnitudes): a wrong weight, layout or slice is off by far more."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    # bfloat16: both round a float32 sum, so two ulps of the largest value; float32: a few ulps per term
    ulps = 2 * torch.finfo(got.dtype).eps if got.dtype == torch.bfloat16 else 4e-6
    tolerance = ulps * max(1.0, float(expected.abs().max()))
    return bool(torch.allclose(got.float(), expected.float(), rtol=0, atol=tolerance))


def _release_originals(model: torch.nn.Module, packed: list[torch.nn.Linear]) -> None:
    """Frees the packed linears' original weights (their GEMMs read the packed copies), except a weight whose
    storage another parameter shares (an lm_head tied to the embeddings)."""
    owners: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        key = param.untyped_storage().data_ptr()
        owners[key] = owners.get(key, 0) + 1
    for linear in packed:
        weight = linear.weight
        if owners.get(weight.untyped_storage().data_ptr(), 0) > 1:
            continue
        # NOTE: an empty tensor of the same dtype and device, so what reads the model's dtype still can
        linear.weight = torch.nn.Parameter(weight.new_empty(0), requires_grad=False)
