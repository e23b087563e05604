"""`engine.v1.EngineService` on grpclib with the upb `_pb2` messages: every RPC of the contract."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, TypeVar

from engine_proto.engine.v1 import cache_pb2, embed_pb2, generate_pb2, info_pb2, tokenize_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceBase
from grpclib.const import Status
from grpclib.exceptions import GRPCError

import engine_server
from engine_server.api import convert, responses
from engine_server.api.adapters import AdapterRpcs, add_model_adapters, loaded_adapters
from engine_server.api.cache_events import serve_cache_events
from engine_server.api.errors import RequestFailed, ServerBusy, to_grpc_error
from engine_server.api.in_flight import CallResources, InFlight
from engine_server.api.security.oneofs import oneof_conflict
from engine_server.api.stream_limit import LocalStreamLimit, StreamSlot
from engine_server.api.streamed_generate import StreamedGenerate
from engine_server.api.transport.limits import count_received
from engine_server.frontend.outputs import EngineState
from engine_server.frontend.types import EngineDead

if TYPE_CHECKING:
    from grpclib.server import Stream

    from engine_server.api.handle import EngineHandle, OutputStream
    from engine_server.api.metrics import ServerMetrics
    from engine_server.api.stream_limit import StreamLimit
    from engine_server.api.transport.fast_path import DirectCall
    from engine_server.frontend.outputs import GenerateRequest

logger = logging.getLogger(__name__)

_Request = TypeVar("_Request")

_STATE = {
    EngineState.STARTING: info_pb2.ENGINE_STATE_STARTING,
    EngineState.SERVING: info_pb2.ENGINE_STATE_SERVING,
    EngineState.DRAINING: info_pb2.ENGINE_STATE_DRAINING,
    EngineState.STOPPED: info_pb2.ENGINE_STATE_DRAINING,
    EngineState.FAILED: info_pb2.ENGINE_STATE_FAILED,
}


class EngineServicer(AdapterRpcs, EngineServiceBase):
    """Stateless per call; holds the engine handle (attached once loaded) and the server-wide stream count."""

    GENERATE_PATH = "/engine.v1.EngineService/Generate"  # transport/fast_path.py serves it when it can

    def __init__(
        self, *, served_model_name: str, max_concurrent_streams: int, metrics: ServerMetrics | None = None,
        in_flight: InFlight | None = None,
    ) -> None:
        self._engine: EngineHandle | None = None
        self._served_model_name = served_model_name
        self._stream_limit: StreamLimit = LocalStreamLimit(max_concurrent_streams)
        self._metrics = metrics
        self._limits = info_pb2.ServerLimits()
        self._started_at = time.monotonic()
        self._is_ready = False
        self._is_draining = False
        self._in_flight = in_flight if in_flight is not None else InFlight()

    # --- lifecycle (called by api.server) -----------------------------------------------------------

    def attach(self, engine: EngineHandle, *, limits: info_pb2.ServerLimits) -> None:
        self._engine = engine
        self._limits = limits

    def use_stream_limit(self, stream_limit: StreamLimit) -> None:
        """--api-workers: the limit shared by every frontend process (before the server is ready)."""
        self._stream_limit = stream_limit

    def set_ready(self) -> None:
        self._is_ready = True

    def begin_drain(self) -> None:
        self._is_draining = True

    @property
    def state(self) -> info_pb2.EngineState.ValueType:
        engine = self._engine
        if engine is not None and engine.state is EngineState.FAILED:
            return info_pb2.ENGINE_STATE_FAILED
        if self._is_draining:
            return info_pb2.ENGINE_STATE_DRAINING
        if engine is None or not self._is_ready:
            return info_pb2.ENGINE_STATE_STARTING
        return _STATE[engine.state]

    def _serving_engine(self) -> EngineHandle:
        engine = self._engine
        if engine is None or not self._is_ready:
            raise EngineDead("the server is starting; retry shortly")
        if self._is_draining:
            raise EngineDead("the server is draining for shutdown")
        if engine.state is EngineState.FAILED:
            raise EngineDead("the engine has failed; the server must be restarted")
        return engine

    async def _receive(self, stream: Stream[_Request, Any], *, rpc: str) -> tuple[_Request, EngineHandle]:
        """The request and the engine to serve it, or the status that refuses the call.

        NOTE: reading stays outside the error mapping, so what `recv_message` raises (an oversized
        message's RESOURCE_EXHAUSTED from transport/limits.py, a dropped stream) reaches grpclib unchanged
        rather than as INTERNAL; a server that cannot serve says UNAVAILABLE before the message is looked at.
        """
        msg = await stream.recv_message()
        try:
            engine = self._serving_engine()
        except Exception as exc:
            raise to_grpc_error(exc, rpc=rpc) from None
        if msg is None:  # pragma: no cover - grpclib always delivers the unary request
            raise GRPCError(Status.INVALID_ARGUMENT, "missing request message")
        return msg, engine

    # --- Generate -----------------------------------------------------------------------------------

    async def Generate(
        self, stream: Stream[generate_pb2.GenerateRequest, generate_pb2.GenerateResponse]
    ) -> None:
        msg, engine = await self._receive(stream, rpc="Generate")
        prompt = None if msg.HasField("token_ids") else await self._tokenized_prompt(msg, engine)
        request, outputs, slot = self._admit(msg, engine, prompt)
        resources = self._in_flight.admit(slot, outputs)
        streamed = StreamedGenerate(stream, outputs, request, slot, self._metrics) if msg.stream else None
        await self._serve_admitted(stream, request, outputs, resources, streamed)

    async def _tokenized_prompt(
        self, msg: generate_pb2.GenerateRequest, engine: EngineHandle
    ) -> list[int] | None:
        """A text or chat prompt's token ids, tokenized on the engine's tokenizer pool (inline when short);
        text that cannot fit in the context is refused before that."""
        try:
            tokenization = convert.prompt_tokenization(msg, tokenizer=engine.tokenizer,
                                                       model_info=engine.model_info)
            if tokenization is None:
                return None
            return await engine.tokenizer_pool.run(tokenization.run, size=tokenization.size)
        except Exception as exc:
            raise to_grpc_error(exc, rpc="Generate", request_id=msg.request_id) from None

    def _admit(
        self, msg: generate_pb2.GenerateRequest, engine: EngineHandle, prompt: list[int] | None
    ) -> tuple[GenerateRequest, OutputStream, StreamSlot]:
        """The request converted and in the engine, and its place under the stream limit; else the status.
        `prompt`: the ids of a text or chat prompt, tokenized already (`_tokenized_prompt`)."""
        request_id = msg.request_id
        stream_limit = self._stream_limit
        try:
            slot = StreamSlot.try_take(stream_limit)
            if slot is None:
                raise ServerBusy(f"too many concurrent streams ({stream_limit.limit}); retry later")
        except Exception as exc:
            raise to_grpc_error(exc, rpc="Generate", request_id=request_id) from None
        try:
            request = convert.to_generate_request(
                msg, tokenizer=engine.tokenizer, model_info=engine.model_info, prompt=prompt
            )
            request_id = request.request_id
            outputs = engine.generate(request)
        except Exception as exc:
            slot.release()
            raise to_grpc_error(exc, rpc="Generate", request_id=request_id) from None
        logger.debug("Generate %s: %d prompt tokens, n=%d, stream=%s",
                     request.request_id, len(request.prompt_token_ids), request.params.n, msg.stream)
        return request, outputs, slot

    async def _serve_admitted(
        self, stream: Stream[generate_pb2.GenerateRequest, generate_pb2.GenerateResponse],
        request: GenerateRequest, outputs: OutputStream, resources: CallResources,
        streamed: StreamedGenerate | None,
    ) -> None:
        """The rest of an admitted call, on its task; releases its resources (taken at admission)."""
        try:
            # NOTE: aclosing: a cancelled call (client cancel, disconnect, deadline) closes the stream, and
            # closing an unfinished stream aborts the request in the engine.
            async with contextlib.aclosing(outputs):
                if streamed is not None:
                    await streamed.run()
                else:
                    await self._send_whole(stream, outputs, request)
        except Exception as exc:
            raise to_grpc_error(exc, rpc="Generate", request_id=request.request_id) from None
        except asyncio.CancelledError:
            logger.debug("Generate %s: cancelled (client, disconnect or deadline): aborted",
                         request.request_id)
            raise
        finally:
            resources.release()

    def start_generate(
        self, stream: Stream[generate_pb2.GenerateRequest, generate_pb2.GenerateResponse], body: bytes,
        call: DirectCall,
    ) -> bool:
        """A streamed Generate served without a task of its own (transport/fast_path.py's direct calls).

        Admits the request and sends the headers here; the messages and the end then leave from the engine's
        output task (StreamedGenerate.push), and the call takes a task (`call.continue_in_task`) only if that
        path cannot go on. False: nothing was done or sent (the server is not serving, the request is not a
        streamed one, or would be refused): `Generate` then serves the call on a task, errors included.
        """
        try:
            engine = self._serving_engine()
        except EngineDead:
            return False
        try:
            msg = generate_pb2.GenerateRequest.FromString(body)
        except Exception:
            return False
        if oneof_conflict(msg, body) is not None:  # refused by `Generate`, on a task
            return False
        if not msg.stream:
            return False
        try:
            tokenization = convert.prompt_tokenization(msg, tokenizer=engine.tokenizer,
                                                       model_info=engine.model_info)
        except Exception:
            return False
        if tokenization is not None and not engine.tokenizer_pool.runs_inline(tokenization.size):
            return False  # a long text is tokenized on the pool, which the call awaits on a task
        slot = StreamSlot.try_take(self._stream_limit)
        if slot is None:
            return False
        try:
            request = convert.to_generate_request(
                msg, tokenizer=engine.tokenizer, model_info=engine.model_info,
                prompt=tokenization.run() if tokenization is not None else None,
            )
            outputs = engine.generate(request)
        except Exception:
            slot.release()
            return False
        count_received(stream)
        resources = self._in_flight.admit(slot, outputs)
        streamed = StreamedGenerate(stream, outputs, request, slot, self._metrics)

        def end() -> None:  # the last message and the OK trailers have left
            resources.release()  # (a finished request: nothing to abort, unless the engine still runs it)
            call.end()

        def resume() -> None:
            call.continue_in_task(
                lambda stream: self._serve_admitted(stream, request, outputs, resources, streamed)
            )

        def cancel() -> None:  # the client reset the stream, or the connection is gone
            logger.debug("Generate %s: cancelled (client or disconnect): aborted", request.request_id)
            streamed.detach()
            resources.release()

        call.on_cancel = cancel
        streamed.start_without_task(on_end=end, on_resume=resume)
        return True

    async def _send_whole(
        self, stream: Stream[generate_pb2.GenerateRequest, generate_pb2.GenerateResponse],
        outputs: OutputStream, request: GenerateRequest,
    ) -> None:
        metrics = self._metrics
        timer = metrics.request_timer() if metrics is not None else None
        collector = responses.Collector(request.params.n)
        async for output in outputs:
            if output.error is not None:
                raise RequestFailed(output.error)
            if timer is not None:
                timer.on_output(sum(len(chunk.token_ids) for chunk in output.chunks))
            collector.add(output)
        response = collector.response(request.request_id)
        await stream.send_message(response)
        if timer is not None and metrics is not None:
            metrics.on_request_done(timer, num_prompt_tokens=len(request.prompt_token_ids),
                                    num_completion_tokens=response.usage.completion_tokens)

    # --- other RPCs ---------------------------------------------------------------------------------

    async def Abort(self, stream: Stream[generate_pb2.AbortRequest, generate_pb2.AbortResponse]) -> None:
        msg = await stream.recv_message()
        response = generate_pb2.AbortResponse()
        try:
            ids = convert.abort_ids(msg) if msg is not None else []
            if self._engine is not None and ids:
                response.aborted_request_ids.extend(await self._engine.abort(ids))
        except Exception as exc:
            raise to_grpc_error(exc, rpc="Abort") from None
        await stream.send_message(response)

    async def Embed(self, stream: Stream[embed_pb2.EmbedRequest, embed_pb2.EmbedResponse]) -> None:
        msg, engine = await self._receive(stream, rpc="Embed")
        try:
            tokenization = convert.embed_tokenization(msg, tokenizer=engine.tokenizer,
                                                      model_info=engine.model_info)
            batch = await engine.tokenizer_pool.run(tokenization.run, size=tokenization.size)
            normalize = msg.normalize if msg.HasField("normalize") else True
            vectors = await engine.embed(batch, normalize=normalize)
        except Exception as exc:
            raise to_grpc_error(exc, rpc="Embed") from None
        response = embed_pb2.EmbedResponse()
        for ids, vector in zip(batch, vectors, strict=True):
            response.embeddings.add(values=vector, num_tokens=len(ids))
        response.usage.prompt_tokens = sum(len(ids) for ids in batch)
        await stream.send_message(response)

    async def Tokenize(
        self, stream: Stream[tokenize_pb2.TokenizeRequest, tokenize_pb2.TokenizeResponse]
    ) -> None:
        msg, engine = await self._receive(stream, rpc="Tokenize")
        try:
            tokenization = convert.tokenize_tokenization(msg, tokenizer=engine.tokenizer,
                                                         model_info=engine.model_info)
            token_ids, offsets = await engine.tokenizer_pool.run(tokenization.run,
                                                                 size=tokenization.size)
        except Exception as exc:
            raise to_grpc_error(exc, rpc="Tokenize") from None
        response = tokenize_pb2.TokenizeResponse()
        response.token_ids.extend(token_ids)
        if offsets is not None:
            for start, end in offsets:
                response.offsets.add(start=start, end=end)
        await stream.send_message(response)

    async def Detokenize(
        self, stream: Stream[tokenize_pb2.DetokenizeRequest, tokenize_pb2.DetokenizeResponse]
    ) -> None:
        msg, engine = await self._receive(stream, rpc="Detokenize")
        try:
            ids, skip_special = convert.detokenize_ids(msg, vocab_size=engine.model_info.vocab_size)
            tokenizer = engine.tokenizer
            # NOTE: a token is a few bytes of text: the ids' count stands for the text's size
            text = await engine.tokenizer_pool.run(
                lambda: tokenizer.decode(ids, skip_special_tokens=skip_special), size=len(ids)
            )
        except Exception as exc:
            raise to_grpc_error(exc, rpc="Detokenize") from None
        await stream.send_message(tokenize_pb2.DetokenizeResponse(text=text))

    async def GetModelInfo(
        self, stream: Stream[info_pb2.GetModelInfoRequest, info_pb2.GetModelInfoResponse]
    ) -> None:
        await stream.recv_message()
        engine = self._engine
        if engine is None:
            raise GRPCError(Status.UNAVAILABLE, "the server is starting; retry shortly")
        response = responses.model_info_response(
            engine.model_info, served_model_name=self._served_model_name,
            has_chat_template=engine.tokenizer.has_chat_template,
        )
        if self._limits.max_adapters and self.state == info_pb2.ENGINE_STATE_SERVING:
            await add_model_adapters(response, engine)
        await stream.send_message(response)

    async def GetServerInfo(
        self, stream: Stream[info_pb2.GetServerInfoRequest, info_pb2.GetServerInfoResponse]
    ) -> None:
        await stream.recv_message()
        response = info_pb2.GetServerInfoResponse(
            server_version=engine_server.__version__,
            api_version="engine.v1",
            uptime_seconds=time.monotonic() - self._started_at,
            state=self.state,
        )
        responses.fill_load(response.load, self._engine.stats() if self._engine is not None else None)
        response.limits.CopyFrom(self._limits)
        if self._limits.max_adapters and self.state == info_pb2.ENGINE_STATE_SERVING:
            response.adapters.extend(info.name for info in await loaded_adapters(self._engine))
        await stream.send_message(response)

    async def GetLoad(self, stream: Stream[info_pb2.GetLoadRequest, info_pb2.GetLoadResponse]) -> None:
        await stream.recv_message()
        response = info_pb2.GetLoadResponse(state=self.state)
        responses.fill_load(response.load, self._engine.stats() if self._engine is not None else None)
        await stream.send_message(response)

    async def FlushCache(
        self, stream: Stream[cache_pb2.FlushCacheRequest, cache_pb2.FlushCacheResponse]
    ) -> None:
        _, engine = await self._receive(stream, rpc="FlushCache")
        try:
            num_flushed = await engine.flush_cache()
        except Exception as exc:
            raise to_grpc_error(exc, rpc="FlushCache") from None
        await stream.send_message(cache_pb2.FlushCacheResponse(num_blocks_flushed=num_flushed))

    async def SubscribeCacheEvents(
        self, stream: Stream[cache_pb2.SubscribeCacheEventsRequest, cache_pb2.SubscribeCacheEventsResponse]
    ) -> None:
        msg, engine = await self._receive(stream, rpc="SubscribeCacheEvents")
        await serve_cache_events(stream, msg, engine.cache_events,
                                 lambda load: responses.fill_load(load, engine.stats()))
