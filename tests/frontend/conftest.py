from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# NOTE: the fake core must be importable by module name in a spawned core process too (it inherits sys.path).
sys.path.insert(0, str(Path(__file__).parent))

from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.tokenizer import Tokenizer
from engine_server.models.tiny import default_model_dir
from fake_core import fake_config, fake_factory, fake_validate


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture
async def fake_engine(model_dir: Path, tokenizer: Tokenizer) -> AsyncIterator[AsyncEngine]:
    """The frontend on a fake core, in process: fast, deterministic echo outputs."""
    engine = await AsyncEngine.start(
        fake_config(model_dir), in_process=True,
        engine_factory=fake_factory(tokenizer.vocab_size, step_delay=0.001), validator=fake_validate,
    )
    yield engine
    await engine.shutdown(timeout=5.0)
