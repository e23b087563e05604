"""The engine core's side of the pipe: load the engine, then drain commands / step / send, until told to stop.

Runs in the core process (default) or on a dedicated thread (in-process mode); never in a coroutine.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Protocol

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
    LoadFailed,
    Ready,
    StatsCommand,
    StepOutput,
)
from engine_server.engine.gpu_modules import keep_gpu_modules_out
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


EngineFactory = Callable[["EngineConfig"], EngineCore]


def default_engine_factory(config: EngineConfig) -> EngineCore:
    # NOTE: imported here so the frontend process never needs the engine's torch code at import time.
    from engine_server.engine.llm_engine import LLMEngine

    return LLMEngine(config)


def run_core_process(conn: Connection, config: EngineConfig, engine_factory: EngineFactory) -> None:
    """Entry point of the core's own process."""
    set_process_title(ENGINE_CORE)
    # NOTE: Ctrl-C reaches the whole process group; the server decides how to stop (drain, then tell us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_gpu_modules_out(config.device)
    run_core(conn, config, engine_factory, own_process=True)
    exit_without_teardown()


def exit_without_teardown() -> None:
    """Ends a core process (single or shared) now, skipping the interpreter's teardown.

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


def run_core(conn: Connection, config: EngineConfig, engine_factory: EngineFactory, *,
             own_process: bool = False) -> None:
    """Entry point of the core process / thread. Returns when shut down, on EOF, or after a failure."""
    try:
        try:
            engine = engine_factory(config)
        except Exception as exc:
            logger.debug("engine load failed", exc_info=True)
            conn.send(LoadFailed(type(exc).__name__, str(exc)))
            return
        if own_process:  # NOTE: not in a thread of someone else's process (tests, in-process mode)
            freeze_startup_heap()
        conn.send(Ready(engine.model_info, engine.stats()))
        _CoreLoop(engine, conn).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the frontend went away: nothing left to serve
    except Exception as exc:
        logger.exception("engine core failed")
        with contextlib.suppress(OSError):
            conn.send(CoreFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        conn.close()


class _CoreLoop:
    __slots__ = ("_conn", "_engine", "_last_stats", "_needs_step", "_rejected")

    def __init__(self, engine: EngineCore, conn: Connection) -> None:
        self._engine = engine
        self._conn = conn
        self._needs_step = False  # a command changed the engine's state: step and report stats
        self._rejected: list[tuple[str, ErrorInfo]] = []
        self._last_stats: EngineStats | None = None

    def run(self) -> None:
        engine, conn = self._engine, self._conn
        while True:
            # 1) Commands: block only when there is no work, so an idle core costs nothing.
            if not engine.has_unfinished() and not self._handle(conn.recv()):
                return
            while conn.poll(0):
                if not self._handle(conn.recv()):
                    return
            # 2) One step; 3) all of its deltas and a fresh snapshot in ONE message.
            if engine.has_unfinished() or self._needs_step:
                deltas = engine.step()
                for request_id, exc in engine.pop_rejected():  # refused after admission (its constraint)
                    self._rejected.append((request_id, ErrorInfo.from_exception(exc)))
                stats = engine.stats()
                # NOTE: a step without news (a chunked-prefill step, say) is not worth a message.
                if deltas or self._rejected or self._needs_step or stats != self._last_stats:
                    rejected, self._rejected = self._rejected, []
                    conn.send(StepOutput.of(deltas, stats, rejected))
                    self._last_stats = stats
                self._needs_step = False

    def _handle(self, commands: tuple[Command, ...]) -> bool:
        """Applies the commands; False once told to shut down."""
        engine = self._engine
        for command in commands:
            if isinstance(command, AddCommand):
                self._needs_step = True
                try:
                    engine.add_request(command.request)
                except (RequestError, EngineOverloaded) as exc:
                    self._rejected.append((command.request.request_id, ErrorInfo.from_exception(exc)))
                except Exception as exc:
                    logger.exception("add_request(%s) failed", command.request.request_id)
                    self._rejected.append((command.request.request_id, ErrorInfo.from_exception(exc)))
            elif isinstance(command, AbortCommand):
                self._needs_step = True
                engine.abort(command.request_ids)
            elif isinstance(command, AbortCompletionsCommand):
                self._needs_step = True
                engine.abort_completions(command.completions)
            elif isinstance(command, EmbedCommand):
                self._conn.send(embed_reply(engine, command))
            elif isinstance(command, StatsCommand):
                self._conn.send(CallReply(command.call_id, engine.stats()))
            elif isinstance(command, AbortElsewhereCommand):
                # A single frontend has no "elsewhere": nothing else runs requests on this core.
                self._conn.send(CallReply(command.call_id, []))
            else:  # ShutdownCommand
                return False
        return True


def embed_reply(engine: EngineCore, command: EmbedCommand) -> CallReply:
    """Runs an EmbedCommand; an error goes back in the reply (unexpected ones are logged here too)."""
    try:
        vectors = engine.embed(command.inputs, normalize=command.normalize)
    except Exception as exc:
        if not isinstance(exc, (RequestError, EngineOverloaded)):
            logger.exception("embed failed")
        return CallReply(command.call_id, error=ErrorInfo.from_exception(exc))
    return CallReply(command.call_id, vectors)
