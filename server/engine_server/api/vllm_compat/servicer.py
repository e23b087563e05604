"""`vllm.grpc.engine.VllmEngine` on our AsyncEngine: what the smg gateway calls on a vLLM gRPC worker.

Cancellation (how smg ends requests):
  1) a streaming client that disconnects: smg sends Abort and keeps the Generate stream open, so Abort ends
     the stream (a `complete` with finish_reason "abort", then OK) instead of generating for nobody;
  2) a non-streaming request, or a stream before its first token: smg resets the HTTP/2 stream; grpclib
     cancels the handler, and closing the engine stream aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from engine_server.api.in_flight import CallResources, InFlight
from engine_server.api.security.oneofs import oneof_conflict
from engine_server.api.stream_limit import StreamSlot
from engine_server.api.transport.fast_send import FastSender
from engine_server.api.transport.limits import count_received
from engine_server.frontend.outputs import EngineState

from .engine_handle import EngineHandle
from .errors import grpc_status
from .flush_cache import flush_cache
from .kv_events import LoadRecords, serve_kv_events
from .output_writer import OutputWriter
from .requests import engine_request_id, generate_request_from_proto, text_tokenization
from .responses import EngineRequestFailed, ResponseBuilder
from .service import RpcStream, VllmEngineBase
from .tokenizer_bundle import TokenizerBundle, build_tokenizer_bundle

if TYPE_CHECKING:
    from engine_server.api.metrics import RequestTimer, ServerMetrics
    from engine_server.api.stream_limit import StreamLimit
    from engine_server.api.transport.fast_path import DirectCall
    from engine_server.frontend.outputs import GenerateRequest

    from .engine_handle import OutputStream

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VllmCompatOptions:
    served_model_name: str | None = None  # None: the model directory's path, as vLLM reports it
    max_num_seqs: int = 0  # the engine's running window; 0 = unknown
    version: str = ""  # reported by GetLoads

    def __post_init__(self) -> None:
        if self.max_num_seqs < 0:
            raise ValueError(f"max_num_seqs: must be >= 0, got {self.max_num_seqs}")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name: must not be empty (None = the model path)")


def _model_type(model_path: str) -> str:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    value = config.get("model_type", "") if isinstance(config, dict) else ""
    return value if isinstance(value, str) else ""


class VllmEngineServicer(VllmEngineBase):
    """Serves once an engine is attached (the server listens before the model is loaded); until then every
    RPC but HealthCheck (which answers unhealthy) is UNAVAILABLE.
    """

    def __init__(
        self,
        engine: EngineHandle | None = None,
        *,
        options: VllmCompatOptions | None = None,
        is_ready: Callable[[], bool] | None = None,
        metrics: ServerMetrics | None = None,
        stream_limit: StreamLimit | None = None,
        in_flight: InFlight | None = None,
    ) -> None:
        self._options = options or VllmCompatOptions()
        self._metrics = metrics  # the server's Prometheus metrics: gateway calls count like engine.v1 ones
        self._stream_limit = stream_limit  # --max-concurrent-streams, shared with engine.v1; None = no limit
        self._is_ready = is_ready  # the server's own readiness (e.g. warmed up, not draining)
        self._start_time = time.time()
        self._last_receive_time = 0.0
        self._engine_or_none: EngineHandle | None = None
        # NOTE: shared with engine.v1 by the server: a drain waits for both services' Generate handlers.
        self._in_flight = in_flight if in_flight is not None else InFlight()
        self._model_type = ""
        self._tokenizer_bundle: TokenizerBundle | None = None
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: EngineHandle) -> None:
        self._engine_or_none = engine
        self._model_type = _model_type(engine.model_info.model_path)
        self._tokenizer_bundle = None

    def use_stream_limit(self, stream_limit: StreamLimit) -> None:
        """The count engine.v1 Generate admits against too (api/server.py), before the server is ready."""
        self._stream_limit = stream_limit

    @property
    def _engine(self) -> EngineHandle:
        engine = self._engine_or_none
        if engine is None:
            raise GRPCError(Status.UNAVAILABLE, "the model is still loading")
        return engine

    @property
    def _serving_engine(self) -> EngineHandle:
        """The engine for new work: UNAVAILABLE while the server warms up or drains, as engine.v1 answers
        (the gateway routes only after a healthy HealthCheck, but a client may call Generate directly)."""
        engine = self._engine
        if self._is_ready is not None and not self._is_ready():
            raise GRPCError(Status.UNAVAILABLE, "the server is warming up or draining; retry shortly")
        return engine

    @contextmanager
    def _stream_slot(self) -> Iterator[StreamSlot | None]:
        """One stream of --max-concurrent-streams for the body, given back however it ends (end, error,
        cancel) unless the sender gave it back first (`FastSender(before_end=...)`); None: no limit."""
        stream_limit = self._stream_limit
        if stream_limit is None:
            yield None
            return
        slot = StreamSlot.try_take(stream_limit)
        if slot is None:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED, f"too many concurrent streams ({stream_limit.limit}); retry later"
            )
        try:
            yield slot
        finally:
            slot.release()

    # --- generation ---------------------------------------------------------------------------------

    async def Generate(self, stream: RpcStream) -> None:
        request = await stream.recv_message()
        if request is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "empty request")
        self._last_receive_time = time.time()
        engine = self._serving_engine
        # NOTE: counted from here (a drain waits for a call being tokenized too), released in one place
        resources = self._in_flight.begin()
        try:
            await self._generate(stream, request, engine, resources)
        finally:
            resources.release()

    async def _generate(self, stream: RpcStream, request: pb.GenerateRequest, engine: EngineHandle,
                        resources: CallResources) -> None:
        # NOTE: the slot is taken before the request is looked at (an overloaded server refuses cheaply) and
        # given back only once the engine stream (aclosing below) is closed.
        with grpc_status("Generate", request.request_id), self._stream_slot() as slot:
            text_ids = await self._tokenized_text(request, engine)
            call = self._admit(stream, request, engine, slot, text_ids)
            resources.admitted(slot, call.outputs)
            # NOTE: aclosing: a cancelled handler (RST_STREAM) or a failed send aborts the engine request.
            async with aclosing(call.outputs):
                await call.run()

    @staticmethod
    async def _tokenized_text(request: pb.GenerateRequest, engine: EngineHandle) -> list[int] | None:
        """A text prompt's ids, tokenized on the engine's tokenizer pool (inline when short); None: token
        ids."""
        tokenization = text_tokenization(request, tokenizer=engine.tokenizer,
                                         max_model_len=engine.model_info.max_model_len)
        if tokenization is None:
            return None
        return await engine.tokenizer_pool.run(tokenization.run, size=tokenization.size)

    def _admit(self, stream: RpcStream, request: pb.GenerateRequest, engine: EngineHandle,
               slot: StreamSlot | None, text_ids: list[int] | None) -> _GenerateCall:
        """The request converted and in the engine, its writer ready; raises what the engine raises.
        `text_ids`: a text prompt's ids, tokenized already (`_tokenized_text`)."""
        generate_request = generate_request_from_proto(
            request, tokenizer=engine.tokenizer, max_model_len=engine.model_info.max_model_len,
            text_ids=text_ids,
        )
        params = generate_request.params
        builder = ResponseBuilder(
            stream=request.stream,
            prompt_token_ids=generate_request.prompt_token_ids,
            num_logprobs=params.logprobs,
            num_prompt_logprobs=params.prompt_logprobs,
            stop_token_ids=params.stop_token_ids,
        )
        metrics = self._metrics
        timer = metrics.request_timer() if metrics is not None else None
        # NOTE: messages as hand-built DATA frames, the bytes grpclib's send_message would write
        # (transport/fast_send.py); grpclib's path for anything unusual.
        sender = FastSender(stream, before_end=slot.release if slot is not None else None)
        writer = OutputWriter(builder, sender, timer)
        outputs = engine.generate(generate_request)
        return _GenerateCall(request, generate_request, builder, sender, writer, outputs, metrics, timer)

    def start_generate(self, stream: RpcStream, body: bytes, direct: DirectCall) -> bool:
        """A streamed Generate served without a task of its own (transport/fast_path.py's direct calls), as
        engine.v1's `EngineServicer.start_generate`: admitted and its headers sent here, its messages and end
        written by the engine's output task (`OutputWriter.push`), a task only if that cannot go on. False:
        nothing was done or sent (`Generate` then serves the call on a task, errors included)."""
        try:
            engine = self._serving_engine
        except GRPCError:
            return False
        try:
            request = pb.GenerateRequest.FromString(body)
        except Exception:
            return False
        if oneof_conflict(request, body) is not None:  # refused by `Generate`, on a task
            return False
        if not request.stream or request.sampling_params.WhichOneof("constraint") is not None:
            return False  # (a constraint: its headers wait for its compile; see `_GenerateCall.run`)
        try:
            tokenization = text_tokenization(request, tokenizer=engine.tokenizer,
                                             max_model_len=engine.model_info.max_model_len)
        except Exception:
            return False
        if tokenization is not None and not engine.tokenizer_pool.runs_inline(tokenization.size):
            return False  # a long text is tokenized on the pool, which the call awaits on a task
        slot = None
        if self._stream_limit is not None:
            slot = StreamSlot.try_take(self._stream_limit)
            if slot is None:
                return False
        try:
            call = self._admit(stream, request, engine, slot,
                               tokenization.run() if tokenization is not None else None)
        except Exception:
            if slot is not None:
                slot.release()
            return False
        count_received(stream)
        self._last_receive_time = time.time()
        resources = self._in_flight.admit(slot, call.outputs)
        outputs, writer = call.outputs, call.writer

        def leave() -> None:
            writer.on_end = None
            outputs.set_ready_callback(None)
            outputs.set_sink(None)
            resources.release()  # (a finished request: nothing to abort)

        def end() -> None:  # the last message and the OK trailers have left
            leave()
            call.request_done()
            direct.end()

        def resume() -> None:
            writer.on_end = None
            direct.continue_in_task(lambda stream: self._resume(call, resources))

        def cancel() -> None:  # the client reset the stream, or the connection is gone
            logger.debug("Generate %s: cancelled (client, disconnect or deadline): aborted",
                         request.request_id)
            leave()

        direct.on_cancel = cancel
        writer.on_end = end
        if not call.sender.try_send_initial_metadata():
            resume()
            return True
        outputs.set_sink(writer.push)
        if not outputs.set_ready_callback(resume):
            resume()
        return True

    async def _resume(self, call: _GenerateCall, resources: CallResources) -> None:
        """The rest of a direct call, on its task; releases its resources (taken at admission)."""
        try:
            with grpc_status("Generate", call.request.request_id):
                async with aclosing(call.outputs):
                    await call.run()
        finally:
            resources.release()

    async def Abort(self, stream: RpcStream) -> None:
        request = await stream.recv_message()
        if request is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "empty request")
        with grpc_status("Abort"):
            await self._engine.abort([engine_request_id(request_id) for request_id in request.request_ids])
        await stream.send_message(pb.AbortResponse())

    async def Embed(self, stream: RpcStream) -> None:
        request = await stream.recv_message()
        if request is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "empty request")
        input_ids = list(request.tokenized.input_ids)
        if not input_ids:
            raise GRPCError(Status.INVALID_ARGUMENT, "tokenized.input_ids: must not be empty")
        with grpc_status("Embed", request.request_id):
            vectors = await self._serving_engine.embed([input_ids], normalize=True)
        embedding = vectors[0]
        await stream.send_message(
            pb.EmbedResponse(embedding=embedding, prompt_tokens=len(input_ids), embedding_dim=len(embedding))
        )

    async def SubscribeKvEvents(self, stream: RpcStream) -> None:
        engine = self._serving_engine
        loads = LoadRecords(engine.stats, block_size=engine.model_info.block_size,
                            max_num_seqs=self._options.max_num_seqs)
        await serve_kv_events(stream, engine.cache_events, loads)

    async def FlushCache(self, stream: RpcStream) -> None:
        request = await stream.recv_message()
        if request is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "empty request")
        with grpc_status("FlushCache"):
            response = await flush_cache(self._serving_engine, request.timeout_s)
        await stream.send_message(response)

    # --- discovery and load ---------------------------------------------------------------------------

    async def HealthCheck(self, stream: RpcStream) -> None:
        await stream.recv_message()
        engine = self._engine_or_none
        state = engine.state if engine is not None else EngineState.STARTING
        # NOTE: draining reports unhealthy so the gateway stops routing here while in-flight requests finish.
        healthy = state is EngineState.SERVING and (self._is_ready is None or self._is_ready())
        message = f"engine {state.value}" if state is not EngineState.SERVING or healthy else "warming up"
        await stream.send_message(pb.HealthCheckResponse(healthy=healthy, message=message))

    async def GetModelInfo(self, stream: RpcStream) -> None:
        await stream.recv_message()
        info = self._engine.model_info
        await stream.send_message(pb.GetModelInfoResponse(
            model_path=info.model_path,
            is_generation=info.task == "generate",
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            supports_vision=False,
            served_model_name=self._options.served_model_name or info.model_path,
            # The frontend loads its tokenizer (and chat template) from the model directory; smg loads the
            # same one from this path, so it must be readable where smg runs (else GetTokenizer's bundle).
            tokenizer_path=info.model_path,
            model_type=self._model_type,
            architectures=[info.architecture],
            eos_token_ids=list(info.eos_token_ids),
            pad_token_id=info.pad_token_id if info.pad_token_id is not None else 0,
            bos_token_id=info.bos_token_id if info.bos_token_id is not None else 0,
            max_req_input_len=info.max_model_len,
        ))

    async def GetServerInfo(self, stream: RpcStream) -> None:
        await stream.recv_message()
        engine = self._engine
        info = engine.model_info
        stats = engine.stats()
        await stream.send_message(pb.GetServerInfoResponse(
            active_requests=stats.num_running + stats.num_waiting,
            is_paused=engine.state is EngineState.DRAINING,
            last_receive_timestamp=self._last_receive_time,
            uptime_seconds=time.time() - self._start_time,
            server_type="vllm-grpc",
            data_parallel_size=1,
            kv_cache_dtype="auto",
            block_size=info.block_size,
            model_dtype=info.dtype,
            max_num_seqs=self._options.max_num_seqs,
            # NOTE: structured outputs: no reasoning parser runs in our engine, so a request's constraint
            # applies from its first generated token (the gateway shapes its forced tool-call grammar by it).
            engine_reasoning_parser="",
            constrained_decoding_start="first_token",
        ))

    async def GetLoads(self, stream: RpcStream) -> None:
        await stream.recv_message()
        engine = self._engine
        stats = engine.stats()
        block_size = engine.model_info.block_size
        # NOTE: the core's snapshot after its latest step (an abort or a finish triggers one), so an idle
        # engine reports zero; the same numbers engine.v1 GetLoad reports: requests (n > 1 counts once).
        num_running, num_waiting = stats.num_running, stats.num_waiting
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=num_running,
            num_waiting_reqs=num_waiting,
            num_total_reqs=num_running + num_waiting,
            num_used_tokens=(stats.num_total_blocks - stats.num_free_blocks) * block_size,
            max_total_num_tokens=stats.num_total_blocks * block_size,
            token_usage=stats.kv_cache_usage,
            max_running_requests=self._options.max_num_seqs,
        )
        await stream.send_message(pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version=self._options.version, dp_rank_count=1,
            loads=[load],
        ))

    async def GetTokenizer(self, stream: RpcStream) -> None:
        await stream.recv_message()
        bundle = self._tokenizer_bundle
        if bundle is None:
            directory = Path(self._engine.model_info.model_path)
            try:
                # NOTE: file I/O and compression stay off the event loop (streams keep flowing meanwhile).
                bundle = await asyncio.to_thread(build_tokenizer_bundle, directory)
            except OSError as exc:
                logger.error("cannot bundle the tokenizer in %s: %s", directory, exc)
                raise GRPCError(Status.FAILED_PRECONDITION, "the tokenizer files are not readable") from exc
            self._tokenizer_bundle = bundle
        for data, sha256 in bundle.chunks():
            await stream.send_message(common_pb2.GetTokenizerChunk(data=data, sha256=sha256))


def vllm_handlers(
    engine: EngineHandle | None = None,
    *,
    options: VllmCompatOptions | None = None,
    is_ready: Callable[[], bool] | None = None,
    metrics: ServerMetrics | None = None,
) -> list[VllmEngineServicer]:
    """The servicers to add to the grpclib Server (beside engine.v1, on the same port).

    Pass `engine=None` when the server listens before the model is loaded, then `attach(engine)` each one.
    """
    return [VllmEngineServicer(engine, options=options, is_ready=is_ready, metrics=metrics)]


@dataclass(slots=True)
class _GenerateCall:
    """One admitted Generate call: its request, engine stream and writer."""

    request: pb.GenerateRequest
    generate_request: GenerateRequest
    builder: ResponseBuilder
    sender: FastSender
    writer: OutputWriter
    outputs: OutputStream
    metrics: ServerMetrics | None
    timer: RequestTimer | None

    async def run(self) -> None:
        """Every output the push sink declines, sent from here in order, then the end (on the call's task)."""
        sender, writer, outputs = self.sender, self.writer, self.outputs
        is_constrained = self.generate_request.structured_output is not None
        if self.request.stream and not sender.initial_metadata_sent and not is_constrained:
            # The headers now, so that every message can leave from the push sink: the engine's output task
            # writes it in place without waking this task (as engine.v1's streamed Generate). stream=false
            # keeps them for its one response; push then only takes the outputs that produce no message.
            # NOTE: a constrained stream's headers leave with its first message (push declines messages
            # until then): its constraint compiles after admission, and a compile error must still end the
            # call before any headers (trailers only, as vLLM answers), which smg turns into HTTP 400, not
            # into an error event inside an HTTP 200 stream.
            await sender.send_initial_metadata()
        outputs.set_sink(writer.push)
        try:
            async for output in outputs:  # what push declined, in order
                try:
                    messages = writer.take(output)
                except EngineRequestFailed as exc:
                    logger.error("request %r failed in the engine: %s", self.request.request_id, exc)
                    raise GRPCError(Status.INTERNAL, "the engine failed running the request") from exc
                writer.is_sending = True
                for message in messages:
                    await sender.send(message)
                writer.is_sending = False
        finally:
            outputs.set_sink(None)
        sender.try_send_ok_trailers()  # unless push did; else grpclib sends them on return
        self.request_done()

    def request_done(self) -> None:
        timer, metrics = self.timer, self.metrics
        if timer is not None and metrics is not None:
            metrics.on_request_done(timer, num_prompt_tokens=len(self.generate_request.prompt_token_ids),
                                    num_completion_tokens=self.builder.num_completion_tokens)
