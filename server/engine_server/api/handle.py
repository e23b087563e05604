"""What the API layer needs from the engine: the `AsyncEngine` handle's surface, as a Protocol.

NOTE: typed structurally so the servicer depends on behaviour, not on the frontend's class; tests pass a fake.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from engine_server.frontend.cache_events import CacheEventHub
    from engine_server.frontend.outputs import (
        EngineState,
        GenerateOutput,
        GenerateRequest,
        OutputSink,
        PlainSink,
    )
    from engine_server.frontend.types import EngineStats, ModelInfo

_T = TypeVar("_T")


class Encoding(Protocol):
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def offsets(self) -> list[tuple[int, int]]: ...


class TokenizerHandle(Protocol):
    """The frontend's tokenizer; every call may run on a worker thread (TokenizerPoolHandle)."""

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of (UTF-8) text one token stands for: a text of more than N times this many bytes
        has more than N tokens."""
    def encode(self, text: str, *, add_special_tokens: bool = True) -> Encoding: ...
    def encode_ids(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...
    @property
    def has_chat_template(self) -> bool: ...
    def render_chat(self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as text (RequestError when the model has none or its template refuses it)."""


class TokenizerPoolHandle(Protocol):
    """Where tokenizer work runs: inline when its input is short, else on a bounded pool of threads."""

    def runs_inline(self, size: int) -> bool: ...
    async def run(self, job: Callable[[], _T], *, size: int) -> _T:
        """`job()`'s result; raises what it raises, or EngineOverloaded when the pool is full."""


class OutputStream(Protocol):
    """One request's outputs; closing it before the end aborts the request in the engine."""

    def __aiter__(self) -> OutputStream: ...
    async def __anext__(self) -> GenerateOutput: ...
    async def aclose(self) -> None: ...
    def close(self) -> None:
        """`aclose()` without awaiting."""
    def set_sink(self, sink: OutputSink | None, plain_sink: PlainSink | None = None) -> None:
        """Offer outputs to `sink` before waking the consumer (None: stop), plain news to `plain_sink` first
        (outputs.PlainSink); a stream may never call either."""
    def set_ready_callback(self, callback: Callable[[], None] | None) -> bool:
        """Call `callback()` once instead of waking a consumer that is not waiting in `__anext__`; False:
        not kept (the stream has something for a consumer now, or cannot call back: iterate it instead)."""


class EngineHandle(Protocol):
    @property
    def model_info(self) -> ModelInfo: ...
    @property
    def tokenizer(self) -> TokenizerHandle: ...
    @property
    def tokenizer_pool(self) -> TokenizerPoolHandle: ...
    @property
    def state(self) -> EngineState: ...
    def add_state_listener(self, listener: Callable[[EngineState], None]) -> None:
        """`listener(new_state)` at every change of `state`, on the event loop."""
    def stats(self) -> EngineStats: ...
    @property
    def cache_events(self) -> CacheEventHub: ...
    @property
    def core_pid(self) -> int | None:
        """The engine core's process (None: it runs in this process, or another frontend started it)."""
    def generate(self, request: GenerateRequest) -> OutputStream: ...
    async def abort(self, request_ids: Sequence[str]) -> list[str]: ...
    async def embed(self, inputs: list[list[int]], *, normalize: bool) -> list[list[float]]: ...
    async def flush_cache(self) -> int:
        """Empties the prefix cache (nothing preempted); how many cached blocks it dropped."""
    def begin_drain(self) -> None: ...
    async def shutdown(self, *, timeout: float) -> None: ...  # noqa: ASYNC109 - the frontend's signature
