"""The engine core's side of the pipes: load the engine, then drain commands / step / send, until told to
stop.

One loop serves 1..N frontends (`engine-server --api-workers N`: one pipe each). It runs in the core process
(default) or on a dedicated thread (`--in-process-engine`, tests); never in a coroutine.

Request ids: when several frontends can share the engine, frontend i's requests run in the engine as
"i/<request_id>", so each frontend has its own slice of the id space (two clients may pick the same id on
different frontends); the prefix is stripped on the way back. A lone frontend's ids pass as they are.
An Abort that reaches one frontend for a request another one runs (a client, or a gateway, aborting over a
second connection: the kernel picks the frontend per connection) comes as an `AbortElsewhereCommand`: the core
aborts the id in every other frontend's slice and replies with the ids it found; the owners' streams end with
the engine's ABORT deltas.
Every frontend gets its own deltas in one StepOutput per step, and the engine-wide stats whenever they change
(GetLoad on any frontend describes the whole engine). A frontend that says shutdown or whose pipe closes is
detached (its requests aborted); frontend 0 (the primary, which owns the core) stops the core.
A frontend that joins later (the primary replaces a worker process that died) comes over the control socket
(`control.py`), under a frontend number never used before, so no delta of the dead worker's requests can reach
its successor; the core greets it with Ready, as the first ones.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Protocol, cast

from engine_server.core.adapter_messages import AdapterCommand, run_adapter_command
from engine_server.core.cache_messages import CacheEventBatch, CacheEventsCommand, CacheEventsStart
from engine_server.core.cache_publisher import CachePublisher
from engine_server.core.control import receive_frontend_pipe
from engine_server.core.messages import (
    AbortCommand,
    AbortCompletionsCommand,
    AbortElsewhereCommand,
    AddCommand,
    CallReply,
    Command,
    CoreFailed,
    EmbedCommand,
    ErrorInfo,
    FlushCacheCommand,
    LoadFailed,
    Ready,
    StatsCommand,
    StepOutput,
)
from engine_server.engine.gpu_modules import keep_gpu_modules_out
from engine_server.engine.lora.errors import AdapterError
from engine_server.engine.types import (
    CompletionDelta,
    EngineOverloaded,
    EngineRequest,
    EngineStats,
    RequestError,
)
from engine_server.gc_policy import freeze_startup_heap
from engine_server.proc_title import ENGINE_CORE, set_process_title

if TYPE_CHECKING:
    from engine_server.engine.config import EngineConfig
    from engine_server.engine.model_info import ModelInfo

logger = logging.getLogger(__name__)


class EngineCore(Protocol):
    """What the loop needs from the engine (`LLMEngine` or a test double)."""

    model_info: ModelInfo

    def add_request(self, request: EngineRequest) -> None: ...
    def abort(self, request_ids: Iterable[str]) -> list[str]: ...
    def abort_completions(self, completions: Iterable[tuple[str, int]]) -> list[tuple[str, int]]: ...
    def step(self) -> list[CompletionDelta]: ...
    def pop_rejected(self) -> list[tuple[str, RequestError]]: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def embed(self, inputs: list[list[int]], *, normalize: bool) -> list[list[float]]: ...
    def flush_cache(self) -> int: ...


EngineFactory = Callable[["EngineConfig"], EngineCore]


def default_engine_factory(config: EngineConfig) -> EngineCore:
    # NOTE: imported here so the frontend process never needs the engine's torch code at import time.
    from engine_server.engine.llm_engine import LLMEngine

    return LLMEngine(config)


def run_core_process(conns: list[Connection], config: EngineConfig, engine_factory: EngineFactory,
                     control: socket.socket | None = None) -> None:
    """Entry point of the core's own process; conns[0] belongs to the primary frontend, which sends the pipes
    of later frontends over `control` (a SOCK_SEQPACKET Unix socket; see `control.send_frontend_pipe`)."""
    set_process_title(ENGINE_CORE)
    # NOTE: Ctrl-C reaches the whole process group; the primary decides how to stop (drain, then tell us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_gpu_modules_out(config.device)
    run_core(conns, config, engine_factory, control=control, own_process=True)
    exit_without_teardown()


def exit_without_teardown() -> None:
    """Ends a core process now, skipping the interpreter's teardown.

    NOTE: with torch and transformers loaded, the final GC and module teardown take ~1 s of CPU on an idle
    machine (more on a busy one, up to `CoreClient.close`'s join budget, after which the core is killed) and
    achieve nothing: the OS frees the memory. The atexit handlers still run (logging flushes, multiprocessing
    unlinks the semaphores it made, e.g. tqdm's lock; else its resource tracker warns of a leak).
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def run_core(conns: list[Connection], config: EngineConfig, engine_factory: EngineFactory, *,
             control: socket.socket | None = None, own_process: bool = False) -> None:
    """Entry point of the core process / thread. Returns when shut down, once the primary's pipe is closed,
    or after a failure (told to every frontend)."""
    loop: CoreLoop | None = None
    try:
        try:
            engine = engine_factory(config)
        except Exception as exc:
            logger.debug("engine load failed", exc_info=True)
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.send(LoadFailed(type(exc).__name__, str(exc)))
            return
        if own_process:  # NOTE: not in a thread of someone else's process (tests, in-process mode)
            freeze_startup_heap()
        loop = CoreLoop(engine, conns, control=control)
        loop.run()
    except Exception as exc:
        logger.exception("engine core failed")
        for conn in conns if loop is None else loop.connections():
            with contextlib.suppress(OSError):
                conn.send(CoreFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        for conn in conns if loop is None else [*conns, *loop.connections()]:
            conn.close()
        if control is not None:
            control.close()


class CoreLoop:
    """Serves the engine to frontends 0..N-1 (and those that join over `control`) until frontend 0 stops."""

    def __init__(self, engine: EngineCore, conns: list[Connection], *,
                 control: socket.socket | None = None) -> None:
        self._engine = engine
        self._conns: dict[int, Connection] = dict(enumerate(conns))
        self._control = control
        # NOTE: ids are namespaced only where another frontend can come: a lone frontend's deltas go back as
        # they are, without a look at each one.
        self._is_shared = len(conns) > 1 or control is not None
        # Per frontend (shared only): engine request id -> completions still running (aborted if it detaches).
        self._owned: dict[int, dict[str, int]] = {index: {} for index in self._conns}
        self._rejected: dict[int, list[tuple[str, ErrorInfo]]] = {}
        self._needs_step = False  # a command changed the engine's state: step and report stats
        self._last_stats: EngineStats | None = None
        self._is_stopping = False
        # The prefix cache's events, to the frontends that subscribe (none: nothing is recorded).
        self._cache = CachePublisher(getattr(engine, "block_manager", None), self._send_cache)

    def connections(self) -> list[Connection]:
        return list(self._conns.values())

    def run(self) -> None:
        engine = self._engine
        for index, conn in list(self._conns.items()):
            self._greet(index, conn)
        while not self._is_stopping and 0 in self._conns:
            # 1) Commands from every frontend: block (on all pipes) only when there is no work, so an idle
            #    core costs nothing.
            self._receive(None if not engine.has_unfinished() and not self._needs_step else 0)
            if self._is_stopping or 0 not in self._conns:
                return
            # 2) One step; 3) each frontend's deltas (and the stats) in one message per frontend.
            if engine.has_unfinished() or self._needs_step:
                deltas = engine.step()
                self._reject_after_admission(engine.pop_rejected())
                self._send_step(deltas, engine.stats())
                self._needs_step = False
            # 4) the step's cache events (or a flush's, without a step), after its outputs
            self._cache.publish()

    def _greet(self, index: int, conn: Connection) -> None:
        try:
            conn.send(Ready(self._engine.model_info, self._engine.stats()))
        except OSError:
            self._detach(index)

    def _receive(self, timeout: float | None) -> None:
        if self._control is None and len(self._conns) == 1:
            # NOTE: the common case (one frontend) polls its pipe directly: no selector made per step.
            index, conn = next(iter(self._conns.items()))
            if conn.poll(timeout):
                self._read(index, conn)
            return
        waitables: list[Connection | socket.socket] = list(self._conns.values())
        if self._control is not None:
            waitables.append(self._control)
        for ready in wait(waitables, timeout):
            if ready is self._control:
                self._accept_frontend(self._control)
            else:
                ready_conn = cast(Connection, ready)
                ready_index = next((i for i, c in self._conns.items() if c is ready_conn), None)
                if ready_index is not None:  # (not detached by a command read earlier in this round)
                    self._read(ready_index, ready_conn)

    def _accept_frontend(self, control: socket.socket) -> None:
        """A frontend that joins now (the primary's replacement for a worker that died)."""
        try:
            joined = receive_frontend_pipe(control)
        except EOFError:  # the primary closed its end: no more frontends will come
            self._control = None
            control.close()
            return
        if joined is not None:
            index, conn = joined
            self._conns[index] = conn
            self._owned[index] = {}
            self._greet(index, conn)

    def _read(self, index: int, conn: Connection) -> None:
        try:
            while conn.poll(0):
                self._handle(index, conn.recv())
                if index not in self._conns or self._is_stopping:
                    return
        except (EOFError, OSError):
            self._detach(index)

    def _handle(self, index: int, commands: tuple[Command, ...]) -> None:
        engine, conn = self._engine, self._conns[index]
        for command in commands:
            if isinstance(command, AddCommand):
                self._needs_step = True
                self._add(index, command.request)
            elif isinstance(command, AbortCommand):
                self._needs_step = True
                engine.abort(self._engine_ids(index, command.request_ids))
            elif isinstance(command, AbortCompletionsCommand):
                self._needs_step = True
                completions = command.completions
                if self._is_shared:
                    completions = tuple((f"{index}/{request_id}", i) for request_id, i in completions)
                engine.abort_completions(completions)
            elif isinstance(command, CacheEventsCommand):
                self._cache.set_subscribed(index, command.subscribe)
            elif isinstance(command, AbortElsewhereCommand):
                found = self._abort_elsewhere(index, command.request_ids)
                self._needs_step = self._needs_step or bool(found)
                conn.send(CallReply(command.call_id, found))
            elif isinstance(command, StatsCommand):
                conn.send(CallReply(command.call_id, engine.stats()))
            elif isinstance(command, FlushCacheCommand):
                # NOTE: between two steps, for every frontend (the core's one cache); nothing is preempted
                conn.send(CallReply(command.call_id, engine.flush_cache()))
            elif isinstance(command, EmbedCommand):
                conn.send(embed_reply(engine, command))
            elif isinstance(command, AdapterCommand):
                conn.send(adapter_reply(engine, command))
            elif index == 0:  # ShutdownCommand from the primary: stop the core
                self._is_stopping = True
                return
            else:  # ShutdownCommand from a worker: it is done
                self._detach(index)
                return

    def _add(self, index: int, request: EngineRequest) -> None:
        engine_request = request
        if self._is_shared:
            # NOTE: every field, positionally (dataclasses.replace costs several times more per request)
            engine_request = EngineRequest(f"{index}/{request.request_id}", request.prompt_token_ids,
                                           request.params, request.structured_output, request.cache_salt,
                                           request.priority, request.adapter)
        try:
            self._engine.add_request(engine_request)
        except (RequestError, EngineOverloaded) as exc:
            self._rejected.setdefault(index, []).append((request.request_id, ErrorInfo.from_exception(exc)))
        except Exception as exc:
            # NOTE: an unexpected admission failure fails that request only, never the core (which every
            # frontend may share).
            logger.exception("add_request(%s) failed", engine_request.request_id)
            self._rejected.setdefault(index, []).append((request.request_id, ErrorInfo.from_exception(exc)))
        else:
            if self._is_shared:
                self._owned[index][engine_request.request_id] = request.params.n

    def _engine_ids(self, index: int, request_ids: Iterable[str]) -> list[str]:
        if not self._is_shared:
            return list(request_ids)
        return [f"{index}/{request_id}" for request_id in request_ids]

    def _abort_elsewhere(self, index: int, request_ids: tuple[str, ...]) -> list[str]:
        """Aborts the ids in every frontend's slice but `index`'s; returns those that were running, in order.

        NOTE: `index` has aborted its own request of that id already. An id names one request per frontend,
        and the id is all an Abort carries: each other frontend's namesake ends too. A lone frontend has no
        "elsewhere".
        """
        wanted = dict.fromkeys(request_ids)
        engine_ids = [f"{other}/{request_id}" for other, owned in self._owned.items() if other != index
                      for request_id in wanted if f"{other}/{request_id}" in owned]
        if not engine_ids:
            return []
        # NOTE: the engine leaves out ids it is aborting already (their owner aborted them first).
        found = {engine_id.partition("/")[2] for engine_id in self._engine.abort(engine_ids)}
        return [request_id for request_id in wanted if request_id in found]

    def _reject_after_admission(self, rejected: list[tuple[str, RequestError]]) -> None:
        """Requests the engine refused after admitting them (a constraint that did not compile)."""
        for engine_id, exc in rejected:
            index, request_id = 0, engine_id
            if self._is_shared:
                prefix, _, request_id = engine_id.partition("/")
                index = int(prefix)
                self._owned.get(index, {}).pop(engine_id, None)
            if index in self._conns:
                self._rejected.setdefault(index, []).append((request_id, ErrorInfo.from_exception(exc)))

    def _send_cache(self, index: int, message: CacheEventBatch | CacheEventsStart) -> None:
        conn = self._conns.get(index)
        if conn is not None:
            try:
                conn.send(message)
            except OSError:
                self._detach(index)

    def _detach(self, index: int) -> None:
        self._cache.set_subscribed(index, False)
        conn = self._conns.pop(index, None)
        if conn is not None:
            conn.close()
        owned = self._owned.pop(index, {})
        if owned:
            self._engine.abort(list(owned))
            self._needs_step = True
        self._rejected.pop(index, None)

    def _send_step(self, deltas: list[CompletionDelta], stats: EngineStats) -> None:
        per_frontend = self._route(deltas) if self._is_shared else {0: deltas}
        # NOTE: a step without news (a chunked-prefill step, say) is not worth a message.
        stats_changed = stats != self._last_stats
        self._last_stats = stats
        for index, conn in list(self._conns.items()):
            mine = per_frontend.get(index)
            rejected = self._rejected.pop(index, [])
            if mine or rejected or stats_changed or self._needs_step:
                try:
                    conn.send(StepOutput.of(mine or [], stats, rejected))
                except OSError:
                    self._detach(index)

    def _route(self, deltas: list[CompletionDelta]) -> dict[int, list[CompletionDelta]]:
        """Each frontend's deltas, its prefix stripped; a finished request leaves its frontend's books."""
        per_frontend: dict[int, list[CompletionDelta]] = {}
        for delta in deltas:
            prefix, _, request_id = delta.request_id.partition("/")
            index = int(prefix)
            if delta.finish_reason is not None:
                owned = self._owned.get(index, {})
                remaining = owned.get(delta.request_id, 1) - 1
                if remaining > 0:
                    owned[delta.request_id] = remaining
                else:
                    owned.pop(delta.request_id, None)
            delta.request_id = request_id
            per_frontend.setdefault(index, []).append(delta)
        return per_frontend


def adapter_reply(engine: EngineCore, command: AdapterCommand) -> CallReply:
    """Runs an AdapterCommand; a refusal goes back in the reply (an unexpected error is logged here too)."""
    try:
        result = run_adapter_command(engine, command)
    except Exception as exc:
        if not isinstance(exc, AdapterError):
            logger.exception("adapter %s failed", command.op)
        return CallReply(command.call_id, error=ErrorInfo.from_exception(exc))
    return CallReply(command.call_id, result)


def embed_reply(engine: EngineCore, command: EmbedCommand) -> CallReply:
    """Runs an EmbedCommand; an error goes back in the reply (unexpected ones are logged here too)."""
    try:
        vectors = engine.embed(command.inputs, normalize=command.normalize)
    except Exception as exc:
        if not isinstance(exc, (RequestError, EngineOverloaded)):
            logger.exception("embed failed")
        return CallReply(command.call_id, error=ErrorInfo.from_exception(exc))
    return CallReply(command.call_id, vectors)
