from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_server.engine.config import EngineConfig
from engine_server.engine.llm_engine import LLMEngine
from engine_server.models.tiny import default_model_dir


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def ref_model(model_dir: Path) -> Any:
    """The same weights through plain transformers (sdpa attention): the reference."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> LLMEngine:
    """A shared default engine; tests using it must leave it idle (every request finished)."""
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=512, max_num_batched_tokens=256))
