"""The LoRA adapters' vocabulary as `api/` sees it (re-exported from `engine/lora/`, torch-free)."""

from __future__ import annotations

from engine_server.engine.lora.errors import (
    AdapterError,
    AdapterExists,
    AdapterInUse,
    AdapterNotFound,
    AdapterSlotsFull,
)
from engine_server.engine.lora.types import AdapterInfo

__all__ = [
    "AdapterError", "AdapterExists", "AdapterInUse", "AdapterInfo", "AdapterNotFound", "AdapterSlotsFull",
]
