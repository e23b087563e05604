"""Loads a model from a local directory (never the hub) and describes it as a ModelInfo (`model_info.py`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_server.engine import malloc_policy
from engine_server.engine.config import EngineConfig
from engine_server.engine.model_info import ModelInfo

logger = logging.getLogger(__name__)

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class KVShape:
    """Per-layer KV geometry of a decoder, read from its config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int  # query heads: num_heads // num_kv_heads share each kv head

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element_size


def check_model_dir(path: str) -> Path:
    """Raises a clear error when the directory is missing or lacks config / weights."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist (no hub access: "
                                f"pass a local directory)")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} has no config.json")
    if not any((model_dir / name).is_file() for name in _WEIGHT_FILES):
        raise FileNotFoundError(f"model directory {str(model_dir)!r} has no weights "
                                f"(expected one of {', '.join(_WEIGHT_FILES)})")
    return model_dir


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r}: expected a JSON object")
    return data


def detect_task(model_dir: Path, architecture: str, requested: str) -> str:
    if requested != "auto":
        return requested
    if architecture.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")):
        return "generate"
    if (model_dir / "modules.json").is_file() or architecture.endswith("Model"):
        return "embed"
    raise ValueError(f"model {str(model_dir)!r}: cannot tell the task of architecture {architecture!r}; "
                     f"set task to 'generate' or 'embed'")


def resolve_dtype(config: EngineConfig, hf_config: Any) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if not config.device.startswith("cuda"):
        return torch.float32  # half precision matmuls are slow or missing on many CPUs
    model_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(model_dtype, str):
        model_dtype = _DTYPES.get(model_dtype)
    return model_dtype if isinstance(model_dtype, torch.dtype) else torch.float32


def kv_shape(hf_config: Any) -> KVShape:
    num_heads = int(hf_config.num_attention_heads)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    return KVShape(num_layers=int(hf_config.num_hidden_layers), num_kv_heads=int(num_kv_heads),
                   head_dim=int(head_dim), num_heads=num_heads)


def special_token_ids(model_dir: Path, hf_config: Any) -> tuple[int | None, tuple[int, ...], int | None]:
    """(bos, eos ids, pad): generation_config.json wins over config.json, as in transformers."""
    gen = read_json(model_dir / "generation_config.json")

    def pick(name: str) -> Any:
        value = gen.get(name)
        return value if value is not None else getattr(hf_config, name, None)

    eos = pick("eos_token_id")
    eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    eos_ids = tuple(int(t) for t in eos_list)
    bos, pad = pick("bos_token_id"), pick("pad_token_id")
    return (int(bos) if bos is not None else None, eos_ids, int(pad) if pad is not None else None)


def max_model_len_of(config: EngineConfig, hf_config: Any) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if limit is None:
            raise ValueError(f"model {config.model!r} does not state max_position_embeddings; "
                             f"set max_model_len")
        return int(limit)
    if limit is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings ({limit})")
    return config.max_model_len


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True, slots=True)
class LoadedModel:
    info: ModelInfo
    model: torch.nn.Module
    dtype: torch.dtype
    device: torch.device
    kv: KVShape | None  # None for embedding models
    embedder: Any = None  # an engine_server.engine.embedding.Embedder for embedding models


def load_model(config: EngineConfig) -> LoadedModel:
    """Loads the model named by config (a local directory) for its task."""
    loaded = _load_for_task(config)
    if loaded.device.type == "cpu":
        # NOTE: after loading, so what loading freed (conversion copies, say) was given back under glibc's
        # defaults; from here on, what a step frees stays for the next (malloc_policy.py)
        malloc_policy.keep_freed_heap()
    return loaded


def _load_for_task(config: EngineConfig) -> LoadedModel:
    from transformers import AutoConfig

    model_dir = check_model_dir(config.model)
    try:
        hf_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model directory {str(model_dir)!r}: cannot read config.json: {e}") from e
    architectures = getattr(hf_config, "architectures", None) or [type(hf_config).__name__]
    architecture = str(architectures[0])
    task = detect_task(model_dir, architecture, config.task)
    dtype = resolve_dtype(config, hf_config)
    device = torch.device(config.device)
    bos, eos_ids, pad = special_token_ids(model_dir, hf_config)
    max_model_len = max_model_len_of(config, hf_config)
    if task == "embed":
        from engine_server.engine.embedding import Embedder

        embedder = Embedder.load(model_dir, dtype=dtype, device=device, max_model_len=max_model_len)
        max_model_len = embedder.max_model_len
        info = ModelInfo(
            model_path=str(model_dir), architecture=architecture, task=task, max_model_len=max_model_len,
            vocab_size=int(hf_config.vocab_size), bos_token_id=bos, eos_token_ids=eos_ids, pad_token_id=pad,
            dtype=str(dtype).removeprefix("torch."), device=str(device), embedding_dim=embedder.dim,
            num_parameters=num_parameters(embedder.model), num_kv_blocks=0, block_size=config.block_size,
        )
        return LoadedModel(info=info, model=embedder.model, dtype=dtype, device=device, kv=None,
                           embedder=embedder)
    from transformers import AutoModelForCausalLM

    from engine_server.engine.attention import register_paged_attention

    model: Any = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=dtype, attn_implementation=register_paged_attention(),
    )
    model = model.to(device).eval()
    kv = kv_shape(hf_config)
    block_bytes = kv.block_bytes(config.block_size, dtype)
    num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // block_bytes)
    # NOTE: one sequence must always fit in the cache on its own, or preemption could not
    # guarantee progress; a small cache therefore lowers max_model_len.
    if num_blocks * config.block_size < max_model_len:
        logger.warning("max_model_len lowered from %d to %d: the KV cache holds only %d blocks of %d tokens",
                       max_model_len, num_blocks * config.block_size, num_blocks, config.block_size)
        max_model_len = num_blocks * config.block_size
    if max_model_len < 2:
        raise ValueError(f"the KV cache ({num_blocks} blocks of {config.block_size}) is too small")
    info = ModelInfo(
        model_path=str(model_dir), architecture=architecture, task=task, max_model_len=max_model_len,
        vocab_size=int(hf_config.vocab_size), bos_token_id=bos, eos_token_ids=eos_ids, pad_token_id=pad,
        dtype=str(dtype).removeprefix("torch."), device=str(device), embedding_dim=None,
        num_parameters=num_parameters(model), num_kv_blocks=num_blocks, block_size=config.block_size,
    )
    return LoadedModel(info=info, model=model, dtype=dtype, device=device, kv=kv)
