"""A core factory that fails to load and imports nothing heavy: its spawned process starts in a second."""

from __future__ import annotations

from engine_server.engine.config import EngineConfig


def failing_factory(config: EngineConfig) -> object:
    raise FileNotFoundError(f"model directory {config.model!r} has no config.json")
