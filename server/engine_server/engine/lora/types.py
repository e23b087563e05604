"""The adapters' plain data and name rule (torch-free: the frontends and the API layer read them)."""

from __future__ import annotations

from dataclasses import dataclass

from engine_server.engine.lora.errors import AdapterError

MAX_NAME_LENGTH = 128


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What ListAdapters / GetModelInfo show of a loaded adapter."""

    name: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    num_requests: int  # running or waiting requests using it now
    is_resident: bool  # in a slot now (its next request needs no copy)


def check_adapter_name(name: str) -> None:
    """1-128 printable characters without surrounding spaces (it appears in logs and responses)."""
    if (not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH or not name.isprintable()
            or name.strip() != name):
        raise AdapterError(f"adapter name must be 1-{MAX_NAME_LENGTH} printable characters without "
                           f"surrounding spaces, got {name!r:.150}")
