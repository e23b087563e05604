"""AsyncEngineClient: the asyncio client (grpclib, upb ``_pb2`` messages on the hot path)."""

# NOTE: `timeout=` here is a gRPC deadline sent to the server (which aborts the request when it passes), not a
# local wait that asyncio.timeout() could replace.
# ruff: noqa: ASYNC109

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from engine_proto.engine.v1 import adapters_pb2, cache_pb2, info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from . import _convert
from ._aio_transport import TRANSPORT_ERRORS, open_channel, translate
from ._health import CHECK_METHOD, build_health_messages
from ._requests import (
    ChatMessage,
    EmbedInput,
    build_abort_request,
    build_detokenize_request,
    build_embed_request,
    build_generate_call,
    build_tokenize_request,
)
from ._retry import Attempts
from .adapters import AdapterInfo, adapter_info, load_request, unload_request
from .cache_events import CacheEventBatch, cache_event_batch, subscribe_request
from .options import DEFAULT_TARGET, ConnectionOptions, TLSConfig, with_overrides
from .params import GenerateOptions, GenerateParams
from .types import (
    EmbedResult,
    GenerateChunk,
    GenerateResult,
    HealthStatus,
    Load,
    ModelInfo,
    ServerInfo,
    TokenizeResult,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["AsyncEngineClient", "AsyncGenerateStream"]

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


class AsyncGenerateStream:
    """The chunks of one Generate call, as an async iterator; closing it cancels the RPC (the server aborts).

    Example::

        async with client.generate("Hello", max_tokens=16) as stream:
            async for chunk in stream:
                print(chunk.text, end="")
        # leaving the block early (break, exception, task cancellation) cancels the request on the server
    """

    __slots__ = ("_chunks", "request_id")

    def __init__(self, chunks: AsyncIterator[GenerateChunk], request_id: str) -> None:
        self._chunks = chunks
        self.request_id = request_id  #: known before the first chunk, so another task can abort it

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        """Cancel the call if it still runs (idempotent)."""
        aclose = getattr(self._chunks, "aclose", None)
        if aclose is not None:
            await aclose()

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def collect(self) -> GenerateResult:
        """Read the rest of the stream into one GenerateResult."""
        collector = _convert.ResultCollector(self.request_id)
        async with self:
            async for chunk in self:
                collector.add(chunk)
        return collector.result()


class AsyncEngineClient:
    """Asyncio client for an engine.v1 server. One HTTP/2 connection, opened lazily, shared by all calls.

    Example::

        async with AsyncEngineClient("127.0.0.1:50051", api_key="secret") as client:
            async for chunk in client.generate("Hello", max_tokens=32, temperature=0.0):
                print(chunk.text, end="", flush=True)
            result = await client.complete(messages=[{"role": "user", "content": "Hi"}], max_tokens=16)
            print(result.text, result.usage)

    ``client.stub`` is the raw grpclib ``EngineServiceStub`` (``_pb2`` messages) for power users.
    """

    def __init__(self, target: str | ConnectionOptions = DEFAULT_TARGET, *, api_key: str | None = None,
                 tls: TLSConfig | None = None, timeout: float | None = None) -> None:
        self.options = with_overrides(target, api_key=api_key, tls=tls, timeout=timeout)
        self._metadata = self.options.metadata()
        self._admin_metadata = self.options.admin_metadata()
        self._channel: Channel | None = None
        self._stub: EngineServiceStub | None = None
        self._health = build_health_messages()

    @property
    def channel(self) -> Channel:
        """The grpclib Channel (created on first use, inside the running event loop)."""
        if self._channel is None:
            self._channel = open_channel(self.options)
        return self._channel

    @property
    def stub(self) -> EngineServiceStub:
        """The raw grpclib stub; pass ``metadata=client.options.metadata()`` to send the API key."""
        if self._stub is None:
            self._stub = EngineServiceStub(self.channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def _unary(self, method: UnaryUnaryMethod[_Req, _Resp], request: _Req,
                     timeout: float | None, *, metadata: tuple[tuple[str, str], ...] | None = None) -> _Resp:
        # Every unary RPC of the contract is safe to repeat, so UNAVAILABLE is retried with backoff.
        attempts = Attempts(self.options, timeout)
        while True:
            try:
                # NOTE: grpclib's UnaryUnaryMethod.__call__ answers a call that ends OK without its reply with
                # an `assert`, and ignores a second reply; both are INTERNAL, as in grpc-go
                async with method.open(timeout=attempts.timeout(),
                                       metadata=self._metadata if metadata is None else metadata) as call:
                    await call.send_message(request, end=True)
                    response = await call.recv_message()
                    if response is not None and await call.recv_message() is not None:
                        raise GRPCError(Status.INTERNAL, "the server sent more than one reply")
                if response is None:  # (after the call's status: an error status is the answer then)
                    raise GRPCError(Status.INTERNAL, "the server ended the call without its reply")
                return response
            except TRANSPORT_ERRORS as exc:
                error = translate(exc)
                delay = attempts.backoff(error)
                if delay is None:
                    raise error from exc
            await asyncio.sleep(delay)

    def generate(self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                 messages: Sequence[ChatMessage] | None = None, request_id: str | None = None,
                 stream: bool = True, timeout: float | None = None, params: GenerateParams | None = None,
                 **options: Unpack[GenerateOptions]) -> AsyncGenerateStream:
        """Stream the completion of ``prompt`` (text), ``token_ids`` or chat ``messages`` (exactly one).

        Knobs are keywords (see :class:`GenerateParams`); None leaves a knob at the server's default.
        ``request_id`` defaults to a fresh uuid4 hex, available as ``stream.request_id`` at once.
        """
        rid, request = build_generate_call(prompt, token_ids=token_ids, messages=messages,
                                           request_id=request_id, stream=stream, params=params,
                                           options=options)
        return AsyncGenerateStream(self._generate(request, rid, timeout), rid)

    async def _generate(self, request: object, request_id: str, timeout: float | None
                        ) -> AsyncIterator[GenerateChunk]:
        attempts = Attempts(self.options, timeout)
        while True:
            received = False
            try:
                method = self.stub.Generate
                async with method.open(timeout=attempts.timeout(), metadata=self._metadata) as call:
                    await call.send_message(request, end=True)  # type: ignore[arg-type]
                    async for response in call:
                        received = True
                        for chunk in _convert.chunks(response):
                            yield chunk
                return
            except TRANSPORT_ERRORS as exc:
                error = translate(exc, request_id=request_id)
                # NOTE: never re-run a Generate that already produced output: the caller saw those tokens.
                delay = attempts.backoff(error, is_repeatable=not received)
                if delay is None:
                    raise error from exc
            await asyncio.sleep(delay)

    async def subscribe_cache_events(self, *, start_sequence_number: int = 0, instance_id: str = "",
                                     timeout: float | None = None) -> AsyncGenerator[CacheEventBatch, None]:
        """The server's prefix-cache events (see :mod:`engine_client.cache_events`): a snapshot, then one
        batch per engine step that changed the cache, and heartbeats; until the caller stops iterating (which
        cancels the call) or the server ends it (raised as an EngineError: ABORTED for a subscriber that fell
        behind, UNAVAILABLE while the server drains). No retries: the caller resumes with its cursor."""
        request = subscribe_request(start_sequence_number, instance_id)
        try:
            async with self.stub.SubscribeCacheEvents.open(timeout=timeout, metadata=self._metadata) as call:
                await call.send_message(request, end=True)
                async for response in call:
                    yield cache_event_batch(response)
        except TRANSPORT_ERRORS as exc:
            raise translate(exc) from exc

    async def complete(self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                       messages: Sequence[ChatMessage] | None = None, request_id: str | None = None,
                       timeout: float | None = None, params: GenerateParams | None = None,
                       **options: Unpack[GenerateOptions]) -> GenerateResult:
        """Generate and return the whole result (one non-streaming response from the server)."""
        stream = self.generate(prompt, token_ids=token_ids, messages=messages, request_id=request_id,
                               stream=False, timeout=timeout, params=params, **options)
        return await stream.collect()

    async def embed(self, inputs: str | Sequence[EmbedInput], *, normalize: bool | None = None,
                    add_special_tokens: bool | None = None, timeout: float | None = None) -> EmbedResult:
        """One vector per input (a text or a list of token ids); the server must run an embedding model."""
        request = build_embed_request(inputs, normalize=normalize, add_special_tokens=add_special_tokens)
        return _convert.embed_result(await self._unary(self.stub.Embed, request, timeout))

    async def tokenize(self, text: str | None = None, *, messages: Sequence[ChatMessage] | None = None,
                       add_special_tokens: bool | None = None, add_generation_prompt: bool | None = None,
                       return_offsets: bool = False, timeout: float | None = None) -> TokenizeResult:
        request = build_tokenize_request(text, messages=messages, add_special_tokens=add_special_tokens,
                                         add_generation_prompt=add_generation_prompt,
                                         return_offsets=return_offsets)
        return _convert.tokenize_result(await self._unary(self.stub.Tokenize, request, timeout))

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                         timeout: float | None = None) -> str:
        request = build_detokenize_request(token_ids, skip_special_tokens=skip_special_tokens)
        return (await self._unary(self.stub.Detokenize, request, timeout)).text

    async def abort(self, request_ids: str | Sequence[str], *,
                    timeout: float | None = None) -> tuple[str, ...]:
        """Abort in-flight Generate requests; returns the ids that were in flight. Unknown ids are ignored."""
        response = await self._unary(self.stub.Abort, build_abort_request(request_ids), timeout)
        return tuple(response.aborted_request_ids)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        response = await self._unary(self.stub.GetModelInfo, info_pb2.GetModelInfoRequest(), timeout)
        return _convert.model_info(response)

    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        response = await self._unary(self.stub.GetServerInfo, info_pb2.GetServerInfoRequest(), timeout)
        return _convert.server_info(response)

    async def load(self, *, timeout: float | None = None) -> Load:
        """The cheap load poll: running/waiting requests, KV cache usage, engine state."""
        response = await self._unary(self.stub.GetLoad, info_pb2.GetLoadRequest(), timeout)
        return _convert.load(response.load, response.state)

    async def flush_cache(self, *, timeout: float | None = None) -> int:
        """Empty the server's prefix cache (running requests go on); returns how many cached blocks it
        dropped. The server applies it between two engine steps; ``timeout`` bounds the wait
        (DEADLINE_EXCEEDED past it: the flush may still happen, and repeating it is safe)."""
        response = await self._unary(self.stub.FlushCache, cache_pb2.FlushCacheRequest(), timeout)
        return response.num_blocks_flushed

    # --- LoRA adapters (admin calls: engine_client/adapters.py) --------------------------------------

    async def load_adapter(self, name: str, path: str, *, timeout: float | None = None) -> AdapterInfo:
        """Load a PEFT LoRA adapter from ``path`` (relative to the server's adapter directory) as ``name``.
        InvalidRequestError for a bad path, bad files or a rank the server does not take (nothing loaded),
        PermissionDeniedError without admin rights."""
        response = await self._unary(self.stub.LoadAdapter, load_request(name, path), timeout,
                                     metadata=self._admin_metadata)
        return adapter_info(response.adapter)

    async def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Unload an adapter; NotFoundError for an unknown name, InvalidRequestError while requests use it."""
        await self._unary(self.stub.UnloadAdapter, unload_request(name), timeout,
                          metadata=self._admin_metadata)

    async def list_adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        """The loaded adapters, with the requests using each now."""
        response = await self._unary(self.stub.ListAdapters, adapters_pb2.ListAdaptersRequest(), timeout,
                                     metadata=self._admin_metadata)
        return [adapter_info(x) for x in response.adapters]

    async def health(self, service: str = "", *, timeout: float | None = None) -> HealthStatus:
        """grpc.health.v1 Check for ``service`` ("" = the whole server, or "engine.v1.EngineService")."""
        h = self._health
        method = UnaryUnaryMethod(self.channel, CHECK_METHOD, h.request_type, h.response_type)
        return h.status(await self._unary(method, h.request(service), timeout))
