"""The engine's vocabulary as the layers above the frontend see it, re-exported from `engine/` and `core/`.

NOTE: `api/` imports these from here, never from `engine/` or `core/` (tests/unit/test_import_rules.py): the
frontend is the one door to what lies below it. All of it is plain data, torch-free.
"""

from __future__ import annotations

from engine_server.core.loop import EngineFactory, default_engine_factory
from engine_server.engine.config import EngineConfig
from engine_server.engine.kv_events import BlocksRemoved, BlocksStored, CacheCleared, CacheEvent
from engine_server.engine.model_info import ModelInfo
from engine_server.engine.types import (
    EngineDead,
    EngineOverloaded,
    EngineStats,
    FinishReason,
    RequestError,
    SamplingParams,
    StructuralTagItem,
    StructuredOutput,
    StructuredOutputKind,
    TokenLogprob,
)

__all__ = [
    "BlocksRemoved",
    "BlocksStored",
    "CacheCleared",
    "CacheEvent",
    "EngineConfig",
    "EngineDead",
    "EngineFactory",
    "EngineOverloaded",
    "EngineStats",
    "FinishReason",
    "ModelInfo",
    "RequestError",
    "SamplingParams",
    "StructuralTagItem",
    "StructuredOutput",
    "StructuredOutputKind",
    "TokenLogprob",
    "default_engine_factory",
]
