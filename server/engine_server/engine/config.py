"""Engine configuration: how the model is loaded and how the KV cache and scheduler are sized."""

from __future__ import annotations

import re
from dataclasses import dataclass

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
DTYPES = ("auto", "float32", "float16", "bfloat16")
TASKS = ("auto", "generate", "embed")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str  # local directory (no hub access)
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # auto: the model's dtype on cuda, float32 on cpu
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 256  # running sequences per step
    max_num_batched_tokens: int = 2048  # token budget per step; longer prompts are prefilled in chunks
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None = derive from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 256 * 2**20
    max_waiting: int = 1024  # bounded waiting queue; beyond it add_request raises EngineOverloaded
    enable_prefix_caching: bool = True
    task: str = "auto"  # auto | generate | embed
    # torch intra-op threads for the engine's process (None = torch's default). Small models on a
    # busy machine run several times faster with 1: every op's thread barrier waits for a CPU.
    num_threads: int | None = None
    # Structured output (engine/structured/): threads compiling constraints, the longest a compile may take
    # (past it the request is INVALID_ARGUMENT), and how many compiled constraints are kept for reuse.
    grammar_compile_threads: int = 1
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 256
    # The longest a step waits for its token masks; past it the rows llguidance cannot mask end (dead end).
    grammar_mask_timeout_s: float = 1.0
    # LoRA adapters (engine/lora/): slots for adapters in use at once (0: no LoRA at all), the largest rank
    # accepted, adapters loaded at start ((name, path) pairs, read as the operator gave them), and the
    # directory run-time loads must resolve inside (None: no run-time loads).
    max_adapters: int = 0
    max_lora_rank: int = 16
    adapters: tuple[tuple[str, str], ...] = ()
    adapter_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: a local model directory is required")
        if not _DEVICE.match(self.device):
            raise ValueError(f"device: expected cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if self.task not in TASKS:
            raise ValueError(f"task: expected one of {TASKS}, got {self.task!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {self.num_kv_blocks}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {self.num_threads}")
        for name in ("grammar_compile_threads", "grammar_cache_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("grammar_compile_timeout_s", "grammar_mask_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_adapters < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_adapters must be >= 0 and max_lora_rank >= 1, got {self.max_adapters} and "
                             f"{self.max_lora_rank}")
        if (self.adapters or self.adapter_dir) and not self.max_adapters:
            raise ValueError("adapters: LoRA adapters need max_adapters >= 1")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes: must be >= 1, got {self.kv_cache_memory_bytes}")
