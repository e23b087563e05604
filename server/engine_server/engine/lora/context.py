"""The forward pass's LoRA hook: the step's active LoRA batch, which every adapted linear consults.

Set by model_runner.py around one forward pass whose batch has at least one row with an adapter; None
otherwise, so a step of base-model requests costs one context-variable read per adapted linear. The
forwards that stand in for a linear's (packed_linears.py's q/k/v parts and plain GEMMs: wrapped by
apply.py) and those that bypass the linears altogether (packed_linears.py's gate|up GEMM of a gated MLP)
call `apply` with the module, its input and its output: torch-free here, so packed_linears.py can import
it without importing the LoRA machinery.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol


class LoraBatch(Protocol):
    def apply(self, module: Any, x: Any, out: Any) -> None:
        """out += the LoRA update of `module` (an nn.Linear) for input x, row by row, in place."""


_ACTIVE: ContextVar[LoraBatch | None] = ContextVar("engine_active_lora", default=None)


def active_lora() -> LoraBatch | None:
    return _ACTIVE.get()


@contextmanager
def lora_active(batch: LoraBatch | None) -> Iterator[None]:
    """Within this block (one forward pass of the engine's model), adapted linears add `batch`'s updates."""
    token = _ACTIVE.set(batch)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
