"""EngineClient: the synchronous client (grpcio, upb ``_pb2`` messages on the hot path)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import grpc
from engine_proto.engine.v1 import adapters_pb2, cache_pb2, generate_pb2, info_pb2
from engine_proto.engine.v1.engine_service_pb2_grpc import EngineServiceStub
from google.protobuf import message

from . import _convert
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
from ._sync_transport import open_channel, translate
from .adapters import AdapterInfo, adapter_info, load_request, unload_request
from .cache_events import CacheEventBatch, cache_event_batch, subscribe_request
from .errors import StatusCode, error_from_status
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

__all__ = ["EngineClient", "GenerateStream"]

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


def _serialize(msg: message.Message) -> bytes:
    return msg.SerializeToString()


class GenerateStream:
    """The chunks of one Generate call, as an iterator; closing it (or dropping it) cancels the RPC.

    Example::

        with client.generate("Hello", max_tokens=16) as stream:
            for chunk in stream:
                print(chunk.text, end="")
        # leaving early (break, exception) cancels the request and the server aborts it
    """

    __slots__ = ("_chunks", "request_id")

    def __init__(self, chunks: Iterator[GenerateChunk], request_id: str) -> None:
        self._chunks = chunks
        self.request_id = request_id  #: known before the first chunk, so another thread can abort it

    def __iter__(self) -> GenerateStream:
        return self

    def __next__(self) -> GenerateChunk:
        return next(self._chunks)

    def close(self) -> None:
        """Cancel the call if it still runs (idempotent)."""
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def collect(self) -> GenerateResult:
        """Read the rest of the stream into one GenerateResult."""
        collector = _convert.ResultCollector(self.request_id)
        with self:
            for chunk in self:
                collector.add(chunk)
        return collector.result()


class EngineClient:
    """Synchronous client for an engine.v1 server (thread-safe; one grpcio channel shared by all calls).

    Example::

        with EngineClient("127.0.0.1:50051") as client:
            for chunk in client.generate("Hello", max_tokens=32, temperature=0.0):
                print(chunk.text, end="", flush=True)
            print(client.complete(token_ids=[1, 2, 3], max_tokens=4).token_ids)

    ``client.stub`` is the raw grpcio ``EngineServiceStub`` (``_pb2`` messages) for power users.
    """

    def __init__(self, target: str | ConnectionOptions = DEFAULT_TARGET, *, api_key: str | None = None,
                 tls: TLSConfig | None = None, timeout: float | None = None) -> None:
        self.options = with_overrides(target, api_key=api_key, tls=tls, timeout=timeout)
        self._metadata = self.options.metadata()
        self._admin_metadata = self.options.admin_metadata()
        self.channel = open_channel(self.options)
        self.stub = EngineServiceStub(self.channel)
        self._health = build_health_messages()
        self._health_check = self.channel.unary_unary(
            CHECK_METHOD,
            request_serializer=_serialize,
            response_deserializer=self._health.response_type.FromString,
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _unary(self, method: Callable[..., _Resp], request: _Req, timeout: float | None, *,
               metadata: tuple[tuple[str, str], ...] | None = None) -> _Resp:
        # Every unary RPC of the contract is safe to repeat, so UNAVAILABLE is retried with backoff.
        attempts = Attempts(self.options, timeout)
        while True:
            try:
                response = method(request, timeout=attempts.timeout(),
                                  metadata=self._metadata if metadata is None else metadata)
            except grpc.RpcError as exc:
                error = translate(exc)
                delay = attempts.backoff(error)
                if delay is None:
                    raise error from exc
            else:
                if response is None:  # NOTE: grpcio's result of a call that ended OK without its message
                    raise error_from_status(StatusCode.INTERNAL,
                                            "the server ended the call without its reply")
                return response
            time.sleep(delay)

    def generate(self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                 messages: Sequence[ChatMessage] | None = None, request_id: str | None = None,
                 stream: bool = True, timeout: float | None = None, params: GenerateParams | None = None,
                 **options: Unpack[GenerateOptions]) -> GenerateStream:
        """Stream the completion of ``prompt`` (text), ``token_ids`` or chat ``messages`` (exactly one).

        Knobs are keywords (see :class:`GenerateParams`); None leaves a knob at the server's default.
        ``request_id`` defaults to a fresh uuid4 hex, available as ``stream.request_id`` at once.
        """
        rid, request = build_generate_call(prompt, token_ids=token_ids, messages=messages,
                                           request_id=request_id, stream=stream, params=params,
                                           options=options)
        return GenerateStream(self._generate(request, rid, timeout), rid)

    def _generate(self, request: generate_pb2.GenerateRequest, request_id: str, timeout: float | None
                  ) -> Iterator[GenerateChunk]:
        attempts = Attempts(self.options, timeout)
        while True:
            received = False
            call = self.stub.Generate(request, timeout=attempts.timeout(), metadata=self._metadata)
            try:
                for response in call:
                    received = True
                    yield from _convert.chunks(response)
                return
            except grpc.RpcError as exc:
                error = translate(exc, request_id=request_id)
                # NOTE: never re-run a Generate that already produced output: the caller saw those tokens.
                delay = attempts.backoff(error, is_repeatable=not received)
                if delay is None:
                    raise error from exc
            finally:
                # Closing the generator early (break, GC, exception) lands here: cancel = abort on the server.
                call.cancel()
            time.sleep(delay)

    def subscribe_cache_events(self, *, start_sequence_number: int = 0, instance_id: str = "",
                               timeout: float | None = None) -> Generator[CacheEventBatch, None, None]:
        """The server's prefix-cache events (see :mod:`engine_client.cache_events`): a snapshot, then one
        batch per engine step that changed the cache, and heartbeats; until the caller closes the iterator
        (which cancels the call) or the server ends it (raised as an EngineError: ABORTED for a subscriber
        that fell behind, UNAVAILABLE while the server drains). No retries: the caller resumes with its
        cursor."""
        request = subscribe_request(start_sequence_number, instance_id)
        call = self.stub.SubscribeCacheEvents(request, timeout=timeout, metadata=self._metadata)
        try:
            for response in call:
                yield cache_event_batch(response)
        except grpc.RpcError as exc:
            raise translate(exc) from exc
        finally:
            call.cancel()

    def complete(self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                 messages: Sequence[ChatMessage] | None = None, request_id: str | None = None,
                 timeout: float | None = None, params: GenerateParams | None = None,
                 **options: Unpack[GenerateOptions]) -> GenerateResult:
        """Generate and return the whole result (one non-streaming response from the server)."""
        return self.generate(prompt, token_ids=token_ids, messages=messages, request_id=request_id,
                             stream=False, timeout=timeout, params=params, **options).collect()

    def embed(self, inputs: str | Sequence[EmbedInput], *, normalize: bool | None = None,
              add_special_tokens: bool | None = None, timeout: float | None = None) -> EmbedResult:
        """One vector per input (a text or a list of token ids); the server must run an embedding model."""
        request = build_embed_request(inputs, normalize=normalize, add_special_tokens=add_special_tokens)
        return _convert.embed_result(self._unary(self.stub.Embed, request, timeout))

    def tokenize(self, text: str | None = None, *, messages: Sequence[ChatMessage] | None = None,
                 add_special_tokens: bool | None = None, add_generation_prompt: bool | None = None,
                 return_offsets: bool = False, timeout: float | None = None) -> TokenizeResult:
        request = build_tokenize_request(text, messages=messages, add_special_tokens=add_special_tokens,
                                         add_generation_prompt=add_generation_prompt,
                                         return_offsets=return_offsets)
        return _convert.tokenize_result(self._unary(self.stub.Tokenize, request, timeout))

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                   timeout: float | None = None) -> str:
        request = build_detokenize_request(token_ids, skip_special_tokens=skip_special_tokens)
        return self._unary(self.stub.Detokenize, request, timeout).text

    def abort(self, request_ids: str | Sequence[str], *, timeout: float | None = None) -> tuple[str, ...]:
        """Abort in-flight Generate requests; returns the ids that were in flight. Unknown ids are ignored."""
        response = self._unary(self.stub.Abort, build_abort_request(request_ids), timeout)
        return tuple(response.aborted_request_ids)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        response = self._unary(self.stub.GetModelInfo, info_pb2.GetModelInfoRequest(), timeout)
        return _convert.model_info(response)

    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        response = self._unary(self.stub.GetServerInfo, info_pb2.GetServerInfoRequest(), timeout)
        return _convert.server_info(response)

    def load(self, *, timeout: float | None = None) -> Load:
        """The cheap load poll: running/waiting requests, KV cache usage, engine state."""
        response = self._unary(self.stub.GetLoad, info_pb2.GetLoadRequest(), timeout)
        return _convert.load(response.load, response.state)

    def flush_cache(self, *, timeout: float | None = None) -> int:
        """Empty the server's prefix cache (running requests go on); returns how many cached blocks it
        dropped. The server applies it between two engine steps; ``timeout`` bounds the wait
        (DEADLINE_EXCEEDED past it: the flush may still happen, and repeating it is safe)."""
        response = self._unary(self.stub.FlushCache, cache_pb2.FlushCacheRequest(), timeout)
        return response.num_blocks_flushed

    # --- LoRA adapters (admin calls: engine_client/adapters.py) --------------------------------------

    def load_adapter(self, name: str, path: str, *, timeout: float | None = None) -> AdapterInfo:
        """Load a PEFT LoRA adapter from ``path`` (relative to the server's adapter directory) as ``name``.
        InvalidRequestError for a bad path, bad files or a rank the server does not take (nothing loaded),
        PermissionDeniedError without admin rights."""
        response = self._unary(self.stub.LoadAdapter, load_request(name, path), timeout,
                               metadata=self._admin_metadata)
        return adapter_info(response.adapter)

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Unload an adapter; NotFoundError for an unknown name, InvalidRequestError while requests use it."""
        self._unary(self.stub.UnloadAdapter, unload_request(name), timeout, metadata=self._admin_metadata)

    def list_adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        """The loaded adapters, with the requests using each now."""
        response = self._unary(self.stub.ListAdapters, adapters_pb2.ListAdaptersRequest(), timeout,
                               metadata=self._admin_metadata)
        return [adapter_info(x) for x in response.adapters]

    def health(self, service: str = "", *, timeout: float | None = None) -> HealthStatus:
        """grpc.health.v1 Check for ``service`` ("" = the whole server, or "engine.v1.EngineService")."""
        h = self._health
        return h.status(self._unary(self._health_check, h.request(service), timeout))
