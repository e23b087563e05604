"""The LoRA adapter management command on the core's pipe, and how the core runs it (engine/lora/).

One command for the three operations: they are rare admin calls, each answered by a CallReply (the adapter's
AdapterInfo, None, or the list; an AdapterError travels back as an ErrorInfo of kind "adapter").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from engine_server.engine.lora.errors import AdapterError
from engine_server.engine.lora.types import AdapterInfo


@dataclass(frozen=True, slots=True)
class AdapterCommand:
    call_id: int
    op: Literal["load", "unload", "list"]
    name: str = ""
    path: str = ""  # load: as the caller sent it; the engine resolves it inside its adapter directory


@runtime_checkable
class AdapterEngine(Protocol):
    """An engine that serves LoRA adapters (LLMEngine); others (the simulated engine) answer that none is."""

    def load_adapter(self, name: str, path: str) -> AdapterInfo: ...
    def unload_adapter(self, name: str) -> None: ...
    def list_adapters(self) -> list[AdapterInfo]: ...


def run_adapter_command(engine: object, command: AdapterCommand) -> AdapterInfo | list[AdapterInfo] | None:
    """Runs the command between two steps (a load reads the files here: admin calls, rare). Raises
    AdapterError where it is refused."""
    if not isinstance(engine, AdapterEngine):
        if command.op == "list":
            return []
        raise AdapterError("this engine serves no LoRA adapters")
    if command.op == "load":
        return engine.load_adapter(command.name, command.path)
    if command.op == "unload":
        engine.unload_adapter(command.name)
        return None
    return engine.list_adapters()
