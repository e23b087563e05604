"""The slice of `AsyncEngine` this service uses, as a Protocol: the real handle and test fakes both fit it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from engine_server.frontend.outputs import EngineState, GenerateOutput, GenerateRequest, OutputSink
from engine_server.frontend.types import EngineStats

if TYPE_CHECKING:
    from engine_server.api.handle import TokenizerPoolHandle
    from engine_server.frontend.cache_events import CacheEventHub
    from engine_server.frontend.types import ModelInfo


class OutputStream(Protocol):
    """What `generate` returns: the request's outputs; `aclose()` aborts an unfinished request."""

    def __aiter__(self) -> AsyncIterator[GenerateOutput]: ...

    async def aclose(self) -> None: ...

    def close(self) -> None:
        """`aclose()` without awaiting."""

    def set_sink(self, sink: OutputSink | None) -> None:
        """Offer each output to `sink` before waking the consumer; what it declines (False) is yielded, in
        order (None: stop offering). A stream may never call it."""

    def set_ready_callback(self, callback: Callable[[], None] | None) -> bool:
        """Call `callback()` once instead of waking a consumer that is not waiting; False: not kept (iterate
        instead)."""


class EncodingLike(Protocol):
    @property
    def token_ids(self) -> list[int]: ...


class TokenizerLike(Protocol):
    @property
    def max_token_bytes(self) -> int: ...  # no token stands for more bytes of text

    def encode(self, text: str, *, add_special_tokens: bool = True) -> EncodingLike: ...

    def encode_ids(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...


class EngineHandle(Protocol):
    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def tokenizer_pool(self) -> TokenizerPoolHandle: ...

    @property
    def state(self) -> EngineState: ...

    @property
    def cache_events(self) -> CacheEventHub: ...

    def stats(self) -> EngineStats: ...

    def generate(self, request: GenerateRequest) -> OutputStream: ...

    async def abort(self, request_ids: Sequence[str]) -> list[str]: ...

    async def embed(self, inputs: list[list[int]], *, normalize: bool) -> list[list[float]]: ...

    async def flush_cache(self) -> int: ...
