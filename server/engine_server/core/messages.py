"""Typed messages exchanged over the pipe between the frontend and the engine core.

The frontend sends a tuple of commands per write (everything queued in one event-loop tick);
the core answers with one `StepOutput` per step (all its deltas and a fresh stats snapshot),
plus a `CallReply` for each call (embed, stats, abort-elsewhere).

NOTE: plain dataclasses of engine vocabulary only: they are pickled across a process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_server.core.adapter_messages import AdapterCommand
from engine_server.core.cache_messages import CacheEventBatch, CacheEventsCommand, CacheEventsStart
from engine_server.engine.lora.errors import AdapterError, rebuild
from engine_server.engine.types import (
    CompletionDelta,
    EngineOverloaded,
    EngineRequest,
    EngineStats,
    RequestError,
)

if TYPE_CHECKING:
    from engine_server.engine.model_info import ModelInfo


# --- frontend -> core -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddCommand:
    request: EngineRequest

    def __reduce__(self) -> tuple[type[AddCommand], tuple[EngineRequest]]:
        return AddCommand, (self.request,)  # (one per request: cheaper than dataclasses' __getstate__)


@dataclass(frozen=True, slots=True)
class AbortCommand:
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AbortCompletionsCommand:
    """Single completions (request_id, index) of n > 1 requests, e.g. one that ended on a stop string."""

    completions: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class AbortElsewhereCommand:
    """Shared core only (`--api-workers`): abort these ids on whichever other frontends run them.

    The reply's result is the ids that were in flight there (`list[str]`); each owning frontend's stream ends
    with the engine's ABORT deltas, as after a drain. Only a shared-core handle (frontend/scale_out.py) sends
    it; a single-frontend core answers it with an empty list (no other frontend exists).
    """

    call_id: int
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class EmbedCommand:
    call_id: int
    inputs: list[list[int]]
    normalize: bool


@dataclass(frozen=True, slots=True)
class StatsCommand:
    call_id: int


@dataclass(frozen=True, slots=True)
class FlushCacheCommand:
    """Empties the prefix cache between two steps; the reply's result is how many cached blocks it dropped."""

    call_id: int


@dataclass(frozen=True, slots=True)
class ShutdownCommand:
    pass


Command = (
    AddCommand | AbortCommand | AbortCompletionsCommand | AbortElsewhereCommand | EmbedCommand | StatsCommand
    | CacheEventsCommand | FlushCacheCommand | AdapterCommand | ShutdownCommand
)


# --- core -> frontend -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """An exception flattened for pickling; `to_exception` rebuilds the engine's error types."""

    kind: str  # "request" | "overloaded" | "adapter" (field_name: the AdapterError's class) | "internal"
    message: str
    field_name: str = ""

    @staticmethod
    def from_exception(exc: BaseException) -> ErrorInfo:
        if isinstance(exc, RequestError):
            # RequestError's message is "field: detail"; keep only the detail to rebuild it.
            detail = str(exc).removeprefix(f"{exc.field_name}: ")
            return ErrorInfo("request", detail, exc.field_name)
        if isinstance(exc, EngineOverloaded):
            return ErrorInfo("overloaded", str(exc))
        if isinstance(exc, AdapterError):
            return ErrorInfo("adapter", str(exc), type(exc).__name__)
        return ErrorInfo("internal", f"{type(exc).__name__}: {exc}")

    def to_exception(self) -> Exception:
        if self.kind == "request":
            return RequestError(self.field_name, self.message)
        if self.kind == "overloaded":
            return EngineOverloaded(self.message)
        if self.kind == "adapter":
            return rebuild(self.field_name, self.message)
        return RuntimeError(self.message)


@dataclass(frozen=True, slots=True)
class Ready:
    """Startup handshake: the model loaded."""

    model_info: ModelInfo
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class LoadFailed:
    """Startup handshake: the model did not load (missing path, bad config, ...)."""

    error_type: str
    message: str


@dataclass(slots=True)
class StepOutput:
    """Everything one core iteration produced: one message per step, never per token.

    NOTE: the commonest delta (completion 0 of a request, new tokens, nothing else) travels as two columns,
    `token_request_ids[i]` got `token_ids[i]`: a list of strings and a list of int lists pickle and
    unpickle in C, where one CompletionDelta object per sequence per step cost a constructor call on each
    side (~2 us per token at 256 streams on the simulated engine). Every other delta stays an object.
    """

    token_request_ids: list[str]
    token_ids: list[list[int]]
    deltas: list[CompletionDelta]  # finishes, logprobs, prompt counts, completions 1..n-1, errors
    stats: EngineStats
    rejected: list[tuple[str, ErrorInfo]] = field(default_factory=list)  # (request_id, why)

    @classmethod
    def of(
        cls, deltas: list[CompletionDelta], stats: EngineStats, rejected: list[tuple[str, ErrorInfo]]
    ) -> StepOutput:
        request_ids: list[str] = []
        token_ids: list[list[int]] = []
        others: list[CompletionDelta] = []
        for delta in deltas:
            if delta.is_plain:
                request_ids.append(delta.request_id)
                token_ids.append(delta.new_token_ids)
            else:
                others.append(delta)
        return cls(request_ids, token_ids, others, stats, rejected)


@dataclass(frozen=True, slots=True)
class CallReply:
    call_id: int
    result: object = None
    error: ErrorInfo | None = None


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The core loop raised: it sends this, then exits."""

    message: str
    traceback: str


CoreMessage = Ready | LoadFailed | StepOutput | CallReply | CoreFailed | CacheEventsStart | CacheEventBatch
