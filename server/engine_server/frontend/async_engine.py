"""`AsyncEngine`: the asyncio-facing handle on the engine core that the API layer uses.

One task reads the core's messages (one per engine step) and processes every delta in one pass:
detokenize, match stop strings, coalesce into the request's pending output, wake its consumer once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_server.core.adapter_messages import AdapterCommand
from engine_server.core.cache_messages import CacheEventBatch, CacheEventsStart
from engine_server.core.loop import EngineFactory, default_engine_factory
from engine_server.core.messages import (
    AbortCommand,
    AbortCompletionsCommand,
    AddCommand,
    CallReply,
    CoreFailed,
    CoreMessage,
    EmbedCommand,
    FlushCacheCommand,
    StatsCommand,
    StepOutput,
)
from engine_server.engine.lora.types import AdapterInfo
from engine_server.engine.types import (
    EngineDead,
    EngineOverloaded,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestError,
)
from engine_server.frontend.cache_events import CacheEventHub
from engine_server.frontend.core_process import CoreClient, EngineLoadError
from engine_server.frontend.outputs import EngineState, GenerateRequest
from engine_server.frontend.request_state import RequestState
from engine_server.frontend.stream import RequestStream
from engine_server.frontend.tokenizer import Tokenizer, TokenizerLoadError
from engine_server.frontend.tokenizer_pool import TokenizerPool

if TYPE_CHECKING:
    from engine_server.engine.config import EngineConfig
    from engine_server.engine.model_info import ModelInfo

logger = logging.getLogger(__name__)

Validator = Callable[[EngineRequest, "ModelInfo"], None]

_REAP_TIMEOUT_S = 5.0  # a core whose pipe broke while it runs on is killed after this
_NO_ENGINE_STATS = EngineStats(num_running=0, num_waiting=0, num_free_blocks=0, num_total_blocks=0)


class AsyncEngine:
    """Start with `await AsyncEngine.start(config)`; stop with `await engine.shutdown(timeout=...)`."""

    def __init__(
        self,
        client: CoreClient,
        model_info: ModelInfo,
        stats: EngineStats,
        *,
        tokenizer: Tokenizer,
        max_pending: int,
        validator: Validator,
    ) -> None:
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.tokenizer_pool = TokenizerPool()  # the API layer's long texts are tokenized there
        self._state = EngineState.SERVING
        self._state_listeners: list[Callable[[EngineState], None]] = []
        self._client = client
        # The prefix cache's events for this frontend's cache-event streams (subscribed while they run).
        self.cache_events = CacheEventHub(client.send)
        self._stats = stats
        self._max_pending = max_pending
        self._validate = validator
        self._requests: dict[str, RequestState] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._is_closing = False
        self._failure: EngineDead | None = None
        self._loop = asyncio.get_running_loop()
        self._reader_task = asyncio.create_task(self._read_loop(), name="engine-outputs")

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        *,
        in_process: bool = False,
        max_pending: int | None = None,
        engine_factory: EngineFactory = default_engine_factory,
        validator: Validator | None = None,
    ) -> AsyncEngine:
        """Start the core (its own process unless `in_process`), load the model and its tokenizer.

        Raises EngineLoadError when the model (or its tokenizer) cannot be loaded.
        """
        if not Path(config.model).is_dir():
            # NOTE: checked here too so the most common mistake costs no core start (seconds of imports).
            raise EngineLoadError(f"cannot load model {config.model!r}: the directory does not exist "
                                  f"(models load from a local directory only)")
        if validator is None:
            from functools import partial

            from engine_server.frontend.validation import validate_request

            validator = partial(validate_request, max_num_seqs=config.max_num_seqs)
        client, ready = await CoreClient.start(config, in_process=in_process, engine_factory=engine_factory)
        try:
            tokenizer = await asyncio.to_thread(Tokenizer, ready.model_info.model_path)
        except TokenizerLoadError as exc:
            await client.close(timeout=10.0)
            raise EngineLoadError(str(exc)) from exc
        except asyncio.CancelledError:
            client.abandon()
            raise
        if max_pending is None:
            max_pending = config.max_num_seqs + config.max_waiting
        return cls(
            client, ready.model_info, ready.stats, tokenizer=tokenizer, max_pending=max_pending,
            validator=validator,
        )

    # --- requests -----------------------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> RequestStream:
        """Admit a request and return its output stream.

        Raises at once (nothing is queued): RequestError (invalid, or a duplicate in-flight request_id),
        EngineOverloaded (too many pending requests), EngineDead (draining, stopped or failed).
        Cancelling or closing the stream aborts the request in the engine.

        NOTE: a request_id stays reserved until the core has confirmed the request's end (an aborted
        request is "in flight" for about one more step), so its deltas can never reach a newer namesake.
        """
        self._check_serving()
        request_id = request.request_id
        if request_id in self._requests:
            raise RequestError("request_id", f"a request with id {request_id!r} is already in flight")
        if len(self._requests) >= self._max_pending:
            raise EngineOverloaded(f"too many pending requests ({self._max_pending}); retry later")
        engine_request = EngineRequest(request_id, request.prompt_token_ids, request.params,
                                       request.structured_output, request.cache_salt, request.priority,
                                       request.adapter)
        self._validate(engine_request, self.model_info)
        state = RequestState(request, self.tokenizer.detokenizers)
        self._requests[request_id] = state
        self._client.send(AddCommand(engine_request))
        return RequestStream(self, state)

    async def abort(self, request_ids: Sequence[str]) -> list[str]:
        """End the named streams with FinishReason.ABORT; returns the ids that were in flight."""
        aborted = []
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is None or state.is_finished:
                continue
            state.finish_locally(FinishReason.ABORT, notify=True)
            self._abort_in_core(state)
            aborted.append(request_id)
        return aborted

    def cancel(self, state: RequestState) -> None:
        """The consumer went away (cancelled or closed its stream): abort without telling it."""
        if not state.is_finished:
            state.finish_locally(FinishReason.ABORT, notify=False)
        self._abort_in_core(state)

    def cancel_threadsafe(self, state: RequestState) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: the engine is gone too
            self._loop.call_soon_threadsafe(self.cancel, state)

    def _abort_in_core(self, state: RequestState) -> None:
        if state.abort_sent or state.num_engine_unfinished == 0 or self.state is EngineState.FAILED:
            return
        state.abort_sent = True
        self._client.send(AbortCommand((state.request_id,)))

    def _abort_completion_in_core(self, state: RequestState, index: int) -> None:
        if state.abort_sent or self.state is EngineState.FAILED:
            return
        self._client.send(AbortCompletionsCommand(((state.request_id, index),)))

    async def embed(self, inputs: list[list[int]], *, normalize: bool) -> list[list[float]]:
        self._check_serving()
        vectors: list[list[float]] = await self._call(
            lambda call_id: EmbedCommand(call_id, inputs, normalize)
        )
        return vectors

    async def flush_cache(self) -> int:
        """Empties the prefix cache (nothing is preempted); returns how many cached blocks it dropped.

        NOTE: one core serves every frontend, so this flushes for all of them (--api-workers).
        """
        self._check_serving()
        num_flushed: int = await self._call(FlushCacheCommand)
        return num_flushed

    # --- LoRA adapters (admin calls; the core loads and checks, engine/lora/) -------------------------

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Loads a LoRA adapter in the core (its path inside the core's adapter directory); AdapterError
        where it is refused, nothing loaded. With --api-workers, one core serves every frontend."""
        self._check_serving()
        info: AdapterInfo = await self._call(lambda call_id: AdapterCommand(call_id, "load", name, path))
        return info

    async def unload_adapter(self, name: str) -> None:
        """Unloads an adapter; AdapterInUse while requests use it, AdapterNotFound for an unknown name."""
        self._check_serving()
        await self._call(lambda call_id: AdapterCommand(call_id, "unload", name))

    async def list_adapters(self) -> list[AdapterInfo]:
        self._check_serving()
        infos: list[AdapterInfo] = await self._call(lambda call_id: AdapterCommand(call_id, "list"))
        return infos

    # --- observation --------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The core's snapshot after its latest step (no round trip); all zero once the core is gone."""
        return self._stats

    async def refresh_stats(self) -> EngineStats:
        """Ask the core for a snapshot now (a round trip)."""
        self._check_alive()
        stats: EngineStats = await self._call(StatsCommand)
        self._stats = stats
        return stats

    async def wait_idle(self) -> EngineStats:
        """Wait until the core has finished every request the frontend sent it; returns fresh stats."""
        while self._requests:
            self._check_alive()
            waiter: asyncio.Future[None] = self._loop.create_future()
            self._idle_waiters.append(waiter)
            await waiter
        return await self.refresh_stats()

    @property
    def num_running(self) -> int:
        return sum(1 for state in self._requests.values() if state.has_output)

    @property
    def num_waiting(self) -> int:
        return sum(1 for state in self._requests.values() if not state.has_output)

    @property
    def num_in_flight(self) -> int:
        """Requests the core still holds (including ones whose consumer already left)."""
        return len(self._requests)

    @property
    def core_pid(self) -> int | None:
        return self._client.pid

    def kill_core(self) -> None:
        """SIGKILL the core process; for tests of the failure path."""
        self._client.kill()

    # --- lifecycle ----------------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._state

    def add_state_listener(self, listener: Callable[[EngineState], None]) -> None:
        """`listener(new_state)` runs on the event loop at every change (e.g. to push health to watchers)."""
        self._state_listeners.append(listener)

    def _set_state(self, state: EngineState) -> None:
        if state is self._state:
            return
        self._state = state
        for listener in self._state_listeners:
            try:
                listener(state)
            except Exception:
                logger.exception("engine state listener failed")

    def begin_drain(self) -> None:
        """Refuse new requests (EngineDead); in-flight ones go on."""
        if self.state is EngineState.SERVING:
            self._set_state(EngineState.DRAINING)
            self.cache_events.fail(EngineDead("the server is draining"))

    async def shutdown(self, *, timeout: float) -> None:  # noqa: ASYNC109 - a drain budget
        """Drain for up to `timeout` seconds, abort what is left, stop the core."""
        if self.state is EngineState.STOPPED:
            return
        self.begin_drain()
        if self._requests and self.state is EngineState.DRAINING:
            try:
                await asyncio.wait_for(self._wait_no_requests(), timeout)
            except TimeoutError:
                await self.abort(list(self._requests))
        self._is_closing = True
        self.tokenizer_pool.shutdown()
        await self._client.close(timeout=max(timeout, 5.0))
        await self._reader_task
        if self.state is not EngineState.FAILED:
            self._set_state(EngineState.STOPPED)

    async def _wait_no_requests(self) -> None:
        while self._requests and self._failure is None:
            waiter: asyncio.Future[None] = self._loop.create_future()
            self._idle_waiters.append(waiter)
            await waiter

    def _check_serving(self) -> None:
        if self.state is not EngineState.SERVING:
            self._check_alive()
            raise EngineDead(f"the engine is {self.state.value}; not accepting requests")

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise EngineDead(str(self._failure))
        if self.state is EngineState.STOPPED:
            raise EngineDead("the engine is stopped")

    async def _call(self, make_command: Callable[[int], Any]) -> Any:
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = future
        self._client.send(make_command(call_id))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    # --- the output task ----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        client = self._client
        try:
            while True:
                # NOTE: all that has arrived is handled in one pass: when this loop fell behind the core, the
                # outputs of several steps reach each consumer (or sink) as one coalesced output.
                messages = [await client.recv(), *client.recv_ready()]
                self._on_messages(messages)
        except EngineDead as exc:
            failure = exc
        except Exception as exc:
            logger.exception("engine output processing failed")
            failure = EngineDead(f"engine output processing failed: {type(exc).__name__}: {exc}")
        self._on_core_gone(failure)  # every request and call gets its error now
        if self.state is EngineState.FAILED:
            # NOTE: the dead core is collected at once (it stayed a zombie until the server exited); how it
            # ended (a signal, an exit code) is what an operator needs in the log.
            how = await client.reap(timeout=_REAP_TIMEOUT_S)
            logger.error("engine core is gone%s: %s", how, failure)

    def _on_messages(self, messages: list[CoreMessage]) -> None:
        touched: dict[RequestState, None] = {}  # an ordered set: each one is woken once, at the end
        try:
            for message in messages:
                if type(message) is StepOutput:
                    self._on_step(message, touched)
                elif type(message) is CallReply:
                    self._on_reply(message)
                elif type(message) is CacheEventBatch:
                    self.cache_events.on_batch(message)
                elif type(message) is CacheEventsStart:
                    self.cache_events.on_start(message)
                elif type(message) is CoreFailed:
                    logger.error("engine core failed: %s\n%s", message.message, message.traceback)
                    raise EngineDead(f"the engine core failed: {message.message}")
                else:  # pragma: no cover - protocol error
                    raise EngineDead(f"unexpected message from the engine core: {type(message).__name__}")
        finally:
            for state in touched:
                if state.has_news:
                    state.wake()

    def _on_step(self, message: StepOutput, touched: dict[RequestState, None]) -> None:
        self._stats = message.stats
        requests = self._requests
        for request_id, error in message.rejected:
            rejected = requests.pop(request_id, None)
            if rejected is not None:
                rejected.fail(error.to_exception())
        for request_id, token_ids in zip(message.token_request_ids, message.token_ids, strict=True):
            state = requests.get(request_id)
            if state is None:
                continue  # finished or failed here already
            touched[state] = None
            if state.add_tokens(token_ids):  # (only a stop string can end anything here)
                self._settle(state, 0, ended_here=True)
        for delta in message.deltas:
            state = requests.get(delta.request_id)
            if state is None:
                continue
            touched[state] = None
            self._settle(state, delta.index, ended_here=state.process(delta))
        if not requests and self._idle_waiters:
            self._wake_idle_waiters()

    def _settle(self, state: RequestState, index: int, *, ended_here: bool) -> None:
        """After a delta: forget a request the engine is done with; stop what ended here on a stop string."""
        if state.num_engine_unfinished == 0:
            del self._requests[state.request_id]
        elif state.num_unfinished == 0 and not state.abort_sent:
            # Every completion ended on a stop string: free its blocks now rather than at max_tokens.
            self._abort_in_core(state)
        elif ended_here:
            # One of n completions ended on a stop string: stop its sequence; the others go on.
            self._abort_completion_in_core(state, index)

    def _on_reply(self, reply: CallReply) -> None:
        future = self._calls.pop(reply.call_id, None)
        if future is None or future.done():
            return  # the caller was cancelled
        if reply.error is not None:
            future.set_exception(reply.error.to_exception())
        else:
            future.set_result(reply.result)

    def _on_core_gone(self, exc: EngineDead) -> None:
        # NOTE: no engine, no load: GetLoad and the metrics report zero from now on, not the last step's.
        self._stats = _NO_ENGINE_STATS
        self._failure = error = EngineDead("the engine was shut down") if self._is_closing else exc
        self._set_state(EngineState.STOPPED if self._is_closing else EngineState.FAILED)
        requests, self._requests = self._requests, {}
        for state in requests.values():
            state.fail(error)
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)
        self.cache_events.fail(error)
        self._wake_idle_waiters()

    def _wake_idle_waiters(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
