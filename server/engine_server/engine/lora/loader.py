"""Reads a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) and checks it.

Everything is checked before anything is kept, so a refused adapter leaves no trace: the config (a LoRA
config of options this engine implements), the rank against max_lora_rank, every tensor's name (a
`lora_A` / `lora_B` weight of a projection the model has), shape and values. Only safetensors are read
(never pickles). With `allowed_root` (run-time loads), the directory and each file read must resolve,
symlinks included, to a path inside it.

Each target module's update is kept as (A^T [in, r], B^T * scaling [r, out]) in the model's dtype:
y += (x @ A^T) @ (B^T * scaling), peft's `lora_B(lora_A(x)) * scaling` with the scaling folded into B
(lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_server.engine.lora.errors import (
    AdapterFormatError,
    AdapterIncompatible,
    AdapterPathError,
    AdapterRankTooLarge,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: attention's and a gated MLP's (the Llama family's names).
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# Options of peft's LoraConfig that change the math; any value but these is refused rather than ignored.
_MUST_BE = {"use_dora": (False, None), "bias": ("none", None), "fan_in_fan_out": (False, None),
            "modules_to_save": (None, []), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
            "lora_bias": (False, None), "target_parameters": (None, []), "use_qalora": (False, None),
            "megatron_config": (None,), "trainable_token_indices": (None,),
            "alora_invocation_tokens": (None,), "layer_replication": (None,), "use_bdlora": (None, False),
            "kasa_config": (None,), "monteclora_config": (None,)}


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A checked adapter, its updates in the model's dtype on the model's device."""

    name: str
    path: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    scaling: float
    # module path in the model (e.g. "model.layers.0.self_attn.q_proj") -> (A^T [in, r], scaled B^T [r, out])
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The kinds of projection it adapts (e.g. ("q_proj", "v_proj")), sorted."""
        return tuple(sorted({module.rsplit(".", 1)[-1] for module in self.weights}))


def resolve_adapter_dir(path: str, allowed_root: str | None) -> Path:
    """The adapter directory `path` names, resolved; with `allowed_root`, relative paths are taken from it
    and the result must lie inside it (after resolving every symlink)."""
    if not path:
        raise AdapterPathError("an adapter path is required")
    if allowed_root is None:
        candidate = Path(path)
    else:
        root = Path(allowed_root).resolve()
        candidate = root / path  # an absolute `path` replaces the root here; checked below like any other
    try:
        resolved = candidate.resolve(strict=True)
    except (OSError, RuntimeError) as e:  # missing, a symlink loop, unreadable
        raise AdapterPathError(f"adapter path {path!r} does not exist or cannot be read") from e
    if allowed_root is not None:
        _check_inside(resolved, Path(allowed_root).resolve(), path)
    if not resolved.is_dir():
        raise AdapterPathError(f"adapter path {path!r} is not a directory")
    return resolved


def _check_inside(resolved: Path, root: Path, shown: str) -> None:
    if resolved != root and not resolved.is_relative_to(root):
        raise AdapterPathError(f"adapter path {shown!r} is outside the server's adapter directory")


def _file(directory: Path, name: str, allowed_root: str | None, shown: str) -> Path:
    """A file of the adapter, resolved (and, with a root, checked: a symlinked file may point outside)."""
    try:
        resolved = (directory / name).resolve(strict=True)
    except (OSError, RuntimeError) as e:
        raise AdapterFormatError(f"adapter {shown!r} has no {name}") from e
    if allowed_root is not None:
        _check_inside(resolved, Path(allowed_root).resolve(), f"{shown}/{name}")
    if not resolved.is_file():
        raise AdapterFormatError(f"adapter {shown!r}: {name} is not a file")
    return resolved


def read_config(directory: Path, *, shown: str, allowed_root: str | None) -> tuple[int, float, bool]:
    """(rank, lora_alpha, use_rslora) of a LoRA adapter_config.json this engine implements."""
    config_path = _file(directory, CONFIG_FILE, allowed_root, shown)
    try:
        with config_path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise AdapterFormatError(f"adapter {shown!r}: {CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
        config = json.loads(raw)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterFormatError(f"adapter {shown!r}: {CONFIG_FILE} is not readable JSON ({e})") from e
    if not isinstance(config, dict):
        raise AdapterFormatError(f"adapter {shown!r}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterFormatError(f"adapter {shown!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, allowed in _MUST_BE.items():
        if config.get(key, allowed[0]) not in allowed:
            raise AdapterFormatError(f"adapter {shown!r}: {key}={config[key]!r} is not supported")
    rank, alpha, rslora = config.get("r"), config.get("lora_alpha", 8), config.get("use_rslora", False)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterFormatError(f"adapter {shown!r}: r must be a positive integer, got {rank!r}")
    if (not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha)
            or alpha == 0):
        raise AdapterFormatError(f"adapter {shown!r}: lora_alpha must be a finite non-zero number")
    if not isinstance(rslora, bool):
        raise AdapterFormatError(f"adapter {shown!r}: use_rslora must be true or false")
    return rank, float(alpha), rslora


def load_adapter(name: str, path: str, *, modules: Mapping[str, tuple[int, int]], max_rank: int,
                 dtype: torch.dtype, device: torch.device, allowed_root: str | None = None) -> LoraAdapter:
    """Reads and checks the adapter at `path`; `modules` maps the model's adaptable module paths to their
    (in_features, out_features)."""
    directory = resolve_adapter_dir(path, allowed_root)
    rank, alpha, rslora = read_config(directory, shown=path, allowed_root=allowed_root)
    if rank > max_rank:
        raise AdapterRankTooLarge(f"adapter {name!r} has rank {rank}; this server's max_lora_rank is "
                                  f"{max_rank}")
    weights_path = _file(directory, WEIGHTS_FILE, allowed_root, path)
    # NOTE: bounded before reading: at most float64 A and B of max_rank for every adaptable module, plus a
    # header; anything larger is not an adapter of this model and is not read into memory.
    limit = sum((i + o) * max_rank * 8 for i, o in modules.values()) + MAX_CONFIG_BYTES
    if weights_path.stat().st_size > limit:
        raise AdapterFormatError(f"adapter {name!r}: {WEIGHTS_FILE} is larger than any adapter of this model")
    tensors = _read_safetensors(weights_path, name)
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    weights = _check_tensors(tensors, name=name, modules=modules, rank=rank)
    return LoraAdapter(
        name=name, path=str(directory), rank=rank, lora_alpha=alpha, use_rslora=rslora, scaling=scaling,
        weights={module: (a.t().to(device=device, dtype=dtype).contiguous(),
                          (b.double() * scaling).t().to(device=device, dtype=dtype).contiguous())
                 for module, (a, b) in weights.items()})


def _read_safetensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # safetensors' own error type, OSError, a truncated or garbled header
        raise AdapterFormatError(f"adapter {name!r}: {WEIGHTS_FILE} is not a readable safetensors file "
                                 f"({type(e).__name__})") from e


def _check_tensors(tensors: Mapping[str, torch.Tensor], *, name: str, modules: Mapping[str, tuple[int, int]],
                   rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path -> (A [r, in], B [out, r]), every tensor named, shaped and valued as a LoRA update."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterFormatError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight "
                                     "(embedding LoRA, DoRA and saved modules are not supported)")
        module = match["module"]
        if module not in modules:
            kind = module.rsplit(".", 1)[-1]
            why = "a module the model does not have" if kind in TARGET_NAMES else (
                f"{kind!r}; adaptable projections are {', '.join(TARGET_NAMES)}")
            raise AdapterIncompatible(f"adapter {name!r} targets {why} ({module})")
        found.setdefault(module, {})[match["ab"]] = tensor
    if not found:
        raise AdapterFormatError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise AdapterFormatError(f"adapter {name!r}: {module} has lora_A or lora_B but not both")
        a, b = pair["A"], pair["B"]
        in_features, out_features = modules[module]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise AdapterIncompatible(
                f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; rank {rank} on "
                f"this model needs ({rank}, {in_features}) and ({out_features}, {rank})")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterFormatError(f"adapter {name!r}: {module}'s weights are not floating point")
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            raise AdapterFormatError(f"adapter {name!r}: {module}'s weights are not all finite")
        out[module] = (a, b)
    return out
