from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_server.engine.llm_engine import LLMEngine
from engine_server.models.tiny import default_model_dir
from engine_testutil import DEVICE, engine_config


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on a loaded machine every op's thread
    # barrier waits for a free CPU: one thread is several times faster here.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def ref_model(model_dir: Path) -> Any:
    """The same weights through plain transformers (sdpa attention): the reference."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(DEVICE).eval()


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> LLMEngine:
    """A shared default engine; tests using it must leave it idle (every request finished)."""
    return LLMEngine(engine_config(model_dir, num_kv_blocks=512, max_num_batched_tokens=256))
