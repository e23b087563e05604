"""One engine core serving several frontend processes (`engine-server --api-workers N`), one pipe each.

Request ids: frontend i's requests run in the engine as "i/<request_id>", so each frontend has its own slice
of the id space (two clients may pick the same id on different frontends); the prefix is stripped on the way
back.
An Abort that reaches one frontend for a request another one runs (a client, or a gateway, aborting over a
second connection: the kernel picks the frontend per connection) comes as an `AbortElsewhereCommand`: the core
aborts the id in every other frontend's slice and replies with the ids it found; the owners' streams end with
the engine's ABORT deltas.
Every frontend gets its own deltas in one StepOutput per step, and the engine-wide stats whenever they change
(GetLoad on any frontend describes the whole engine). A frontend that says shutdown or whose pipe closes is
detached (its requests aborted); frontend 0 (the primary, which owns the core process) stops the core.
A frontend that joins later (the primary replaces a worker process that died) comes over the control socket:
the primary sends one end of a new pipe (SCM_RIGHTS) with a frontend number never used before, so no delta
of the dead worker's requests can reach its successor; the core greets it with Ready, as the first ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import struct
import traceback
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, cast

from engine_server.core.loop import embed_reply, exit_without_teardown
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
    from engine_server.core.loop import EngineCore, EngineFactory
    from engine_server.engine.config import EngineConfig

logger = logging.getLogger(__name__)


def run_multi_core_process(
    conns: list[Connection], config: EngineConfig, engine_factory: EngineFactory,
    control: socket.socket | None = None,
) -> None:
    """Entry point of the shared core's process; conns[0] belongs to the primary frontend, which sends the
    pipes of later frontends over `control` (a SOCK_SEQPACKET Unix socket; see `send_frontend_pipe`)."""
    set_process_title(ENGINE_CORE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the primary decides how to stop
    keep_gpu_modules_out(config.device)
    try:
        try:
            engine = engine_factory(config)
        except Exception as exc:
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.send(LoadFailed(type(exc).__name__, str(exc)))
            return
        freeze_startup_heap()  # this process is the core's own: see gc_policy.py
        for conn in conns:
            conn.send(Ready(engine.model_info, engine.stats()))
        _MultiCoreLoop(engine, conns, control=control).run()
    except Exception as exc:
        logger.exception("engine core failed")
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(CoreFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        for conn in conns:
            conn.close()
    exit_without_teardown()


_FRONTEND_NUMBER = struct.Struct("!I")  # a control message: the frontend's number, with its pipe's descriptor


def send_frontend_pipe(control: socket.socket, frontend: int, conn: Connection) -> None:
    """The primary's side of the control socket: frontend number `frontend` is served over `conn` (whose
    descriptor the core gets a copy of; close it after). Raises OSError when the core is gone."""
    socket.send_fds(control, [_FRONTEND_NUMBER.pack(frontend)], [conn.fileno()])


class _MultiCoreLoop:
    def __init__(self, engine: EngineCore, conns: list[Connection], *,
                 control: socket.socket | None = None) -> None:
        self._engine = engine
        self._conns: dict[int, Connection] = dict(enumerate(conns))
        self._control = control
        # Per frontend: engine request id -> completions still running (aborted if the frontend goes away).
        self._owned: dict[int, dict[str, int]] = {index: {} for index in self._conns}
        self._rejected: dict[int, list[tuple[str, ErrorInfo]]] = {}
        self._needs_step = False
        self._last_stats: EngineStats | None = None
        self._is_stopping = False

    def run(self) -> None:
        engine = self._engine
        while True:
            # 1) Commands from every frontend; block (on all pipes) only when there is no work.
            timeout = None if not engine.has_unfinished() and not self._needs_step else 0
            waitables: list[Connection | socket.socket] = list(self._conns.values())
            if self._control is not None:
                waitables.append(self._control)
            for ready in wait(waitables, timeout):
                if ready is self._control:
                    self._accept_frontend(self._control)
                else:
                    self._read(cast(Connection, ready))
            if self._is_stopping or 0 not in self._conns:
                return
            # 2) One step; 3) each frontend's deltas (and the stats) in one message per frontend.
            if engine.has_unfinished() or self._needs_step:
                deltas = engine.step()
                self._reject_after_admission(engine.pop_rejected())
                self._send_step(deltas, engine.stats())
                self._needs_step = False

    def _reject_after_admission(self, rejected: list[tuple[str, RequestError]]) -> None:
        """Requests the engine refused after admitting them (a constraint that did not compile)."""
        for engine_id, exc in rejected:
            prefix, _, request_id = engine_id.partition("/")
            index = int(prefix)
            self._owned.get(index, {}).pop(engine_id, None)
            if index in self._conns:
                self._rejected.setdefault(index, []).append((request_id, ErrorInfo.from_exception(exc)))

    def _accept_frontend(self, control: socket.socket) -> None:
        """A frontend that joins now (the primary's replacement for a worker that died)."""
        try:
            data, fds, _flags, _address = socket.recv_fds(control, _FRONTEND_NUMBER.size, 1)
        except OSError:
            data, fds = b"", []
        if len(data) != _FRONTEND_NUMBER.size or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            if not data:  # the primary closed its end: no more frontends will come
                self._control = None
                control.close()
            return
        (index,) = _FRONTEND_NUMBER.unpack(data)
        conn = Connection(fds[0])
        self._conns[index] = conn
        self._owned[index] = {}
        try:
            conn.send(Ready(self._engine.model_info, self._engine.stats()))
        except OSError:
            self._detach(index)

    def _read(self, conn: Connection) -> None:
        index = next(i for i, c in self._conns.items() if c is conn)
        try:
            while conn.poll(0):
                self._handle(index, conn.recv())
                if index not in self._conns:
                    return
        except (EOFError, OSError):
            self._detach(index)

    def _handle(self, index: int, commands: tuple[Command, ...]) -> None:
        engine, prefix = self._engine, f"{index}/"
        for command in commands:
            if isinstance(command, AddCommand):
                self._needs_step = True
                request = command.request
                engine_id = prefix + request.request_id
                try:
                    engine.add_request(EngineRequest(engine_id, request.prompt_token_ids, request.params,
                                                     request.structured_output))
                    self._owned[index][engine_id] = request.params.n
                except (RequestError, EngineOverloaded) as exc:
                    self._rejected.setdefault(index, []).append(
                        (request.request_id, ErrorInfo.from_exception(exc)))
                except Exception as exc:
                    # NOTE: like the single-frontend core: an unexpected admission failure fails that
                    # request only, never the core every frontend shares.
                    logger.exception("add_request(%s) failed", engine_id)
                    self._rejected.setdefault(index, []).append(
                        (request.request_id, ErrorInfo.from_exception(exc)))
            elif isinstance(command, AbortCommand):
                self._needs_step = True
                engine.abort([prefix + request_id for request_id in command.request_ids])
            elif isinstance(command, AbortCompletionsCommand):
                self._needs_step = True
                engine.abort_completions([(prefix + request_id, i) for request_id, i in command.completions])
            elif isinstance(command, AbortElsewhereCommand):
                found = self._abort_elsewhere(index, command.request_ids)
                self._needs_step = self._needs_step or bool(found)
                self._conns[index].send(CallReply(command.call_id, found))
            elif isinstance(command, StatsCommand):
                self._conns[index].send(CallReply(command.call_id, engine.stats()))
            elif isinstance(command, EmbedCommand):
                self._conns[index].send(embed_reply(engine, command))
            elif index == 0:  # ShutdownCommand from the primary: stop the core
                self._is_stopping = True
                return
            else:  # ShutdownCommand from a worker: it is done
                self._detach(index)
                return

    def _abort_elsewhere(self, index: int, request_ids: tuple[str, ...]) -> list[str]:
        """Aborts the ids in every frontend's slice but `index`'s; returns those that were running, in order.

        NOTE: `index` has aborted its own request of that id already. An id names one request per frontend,
        and the id is all an Abort carries: each other frontend's namesake ends too.
        """
        wanted = dict.fromkeys(request_ids)
        engine_ids = [f"{other}/{request_id}" for other, owned in self._owned.items() if other != index
                      for request_id in wanted if f"{other}/{request_id}" in owned]
        if not engine_ids:
            return []
        # NOTE: the engine leaves out ids it is aborting already (their owner aborted them first).
        found = {engine_id.partition("/")[2] for engine_id in self._engine.abort(engine_ids)}
        return [request_id for request_id in wanted if request_id in found]

    def _detach(self, index: int) -> None:
        conn = self._conns.pop(index, None)
        if conn is not None:
            conn.close()
        owned = self._owned.pop(index, {})
        if owned:
            self._engine.abort(list(owned))
            self._needs_step = True
        self._rejected.pop(index, None)

    def _send_step(self, deltas: list[CompletionDelta], stats: EngineStats) -> None:
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
