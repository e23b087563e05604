"""Several frontend processes over one engine core (`engine-server --api-workers N`): the frontend side.

The primary frontend starts the shared core (core/loop.py) with one pipe per frontend and gets an
`AsyncEngine` on pipe 0; it hands the other pipes to its worker processes, which `attach_engine` to theirs
(a worker started later, in place of one that died, gets a new pipe: `PrimaryEngine.new_frontend_pipe`).
Everything above the pipe (detokenizer, stop strings, coalescing) is the ordinary AsyncEngine; only `abort`
reaches past its own frontend (`SharedCoreEngine`), since a client may abort over another connection.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine_server.core.control import send_frontend_pipe
from engine_server.core.loop import EngineFactory, default_engine_factory, run_core_process
from engine_server.core.messages import AbortElsewhereCommand, LoadFailed, Ready
from engine_server.engine.types import EngineDead
from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.core_process import CoreClient, CoreGone, EngineLoadError, core_environment
from engine_server.frontend.outputs import EngineState
from engine_server.frontend.tokenizer import Tokenizer, TokenizerLoadError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from engine_server.engine.config import EngineConfig

BeforeShutdown = Callable[[float], Awaitable[None]]


class SharedCoreEngine(AsyncEngine):
    """A frontend's handle on the shared core: Abort also finds the requests the other frontends run."""

    async def abort(self, request_ids: Sequence[str]) -> list[str]:
        aborted = await super().abort(request_ids)
        # NOTE: an id not in flight here may be on another frontend; only the core knows (a round trip).
        done_here = set(aborted)
        elsewhere = tuple(dict.fromkeys(rid for rid in request_ids if rid not in done_here))
        if not elsewhere or self.state in (EngineState.FAILED, EngineState.STOPPED):
            return aborted
        try:
            found: list[str] = await self._call(lambda call_id: AbortElsewhereCommand(call_id, elsewhere))
        except EngineDead:
            return aborted  # the core is gone: nothing runs anywhere any more
        return aborted + found


class PrimaryEngine(SharedCoreEngine):
    """The primary frontend's handle: it hands pipes to the core for replacement workers, and on shutdown the
    workers stop first (they share its core)."""

    _before_shutdown: BeforeShutdown | None = None
    _control: socket.socket | None = None
    _next_frontend = 0

    def set_before_shutdown(self, hook: BeforeShutdown) -> None:
        self._before_shutdown = hook

    def use_control(self, control: socket.socket, *, next_frontend: int) -> None:
        self._control = control
        self._next_frontend = next_frontend

    def new_frontend_pipe(self) -> Connection:
        """A pipe to the shared core for a new worker process (one that replaces a worker that died): the core
        gets the other end and greets the worker with Ready. Raises EngineDead when the core is gone."""
        if self._control is None or self.state is not EngineState.SERVING:
            raise EngineDead(f"the engine is {self.state.value}")
        ours, theirs = multiprocessing.get_context("spawn").Pipe(duplex=True)
        frontend, self._next_frontend = self._next_frontend, self._next_frontend + 1
        try:
            send_frontend_pipe(self._control, frontend, theirs)
        except OSError as exc:
            ours.close()
            raise EngineDead(f"cannot reach the engine core: {exc}") from exc
        finally:
            theirs.close()
        return ours

    async def shutdown(self, *, timeout: float) -> None:  # noqa: ASYNC109 - a drain budget
        hook, self._before_shutdown = self._before_shutdown, None
        if hook is not None:
            self.begin_drain()
            await hook(timeout)
        if self._control is not None:
            self._control.close()
            self._control = None
        await super().shutdown(timeout=timeout)


async def start_shared_core(
    config: EngineConfig, *, num_frontends: int, engine_factory: EngineFactory = default_engine_factory
) -> tuple[PrimaryEngine, list[Connection]]:
    """Start the core process; returns the primary's handle and the pipes for frontends 1..N-1."""
    if num_frontends < 1:
        raise ValueError(f"num_frontends: must be >= 1, got {num_frontends}")
    # NOTE: "spawn", not fork: the parent runs an event loop and threads; torch is not fork-safe.
    ctx = multiprocessing.get_context("spawn")
    pairs = [ctx.Pipe(duplex=True) for _ in range(num_frontends)]
    children = [child for _, child in pairs]
    # NOTE: SOCK_SEQPACKET: one control message per frontend, each with its descriptor, never merged
    control, core_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    process = ctx.Process(target=run_core_process, name="engine-core", daemon=True,
                          args=(children, config, engine_factory, core_control))
    with core_environment():  # e.g. passive OpenMP waiting: see core_process.py
        process.start()
    core_control.close()
    for _, child in pairs:
        child.close()  # else a frontend never sees EOF when the core dies
    try:
        engine = await _attach(pairs[0][0], config, process=process, engine_cls=PrimaryEngine)
    except BaseException:
        control.close()
        for parent, _ in pairs[1:]:
            parent.close()
        raise
    assert isinstance(engine, PrimaryEngine)
    engine.use_control(control, next_frontend=num_frontends)
    return engine, [parent for parent, _ in pairs[1:]]


async def attach_engine(conn: Connection, config: EngineConfig) -> SharedCoreEngine:
    """A worker frontend's handle on the shared core, over the pipe the primary gave it."""
    return await _attach(conn, config, process=None, engine_cls=SharedCoreEngine)


async def _attach(
    conn: Connection, config: EngineConfig, *, process: BaseProcess | None, engine_cls: type[SharedCoreEngine]
) -> SharedCoreEngine:
    client = await CoreClient.connect(conn, process=process, thread=None)
    try:
        first = await client.recv()
        if isinstance(first, LoadFailed):
            raise EngineLoadError(f"cannot load model {config.model!r}: {first.error_type}: {first.message}")
        if not isinstance(first, Ready):
            raise EngineLoadError(f"unexpected handshake message {type(first).__name__}")
        tokenizer = await asyncio.to_thread(Tokenizer, first.model_info.model_path)
    except CoreGone as exc:
        await client.close(timeout=5.0)
        raise EngineLoadError("engine core exited while loading the model") from exc
    except TokenizerLoadError as exc:
        await client.close(timeout=5.0)
        raise EngineLoadError(str(exc)) from exc
    except BaseException:
        client.abandon()
        raise
    from engine_server.frontend.validation import validate_request

    validator = partial(validate_request, max_num_seqs=config.max_num_seqs)
    return engine_cls(client, first.model_info, first.stats, tokenizer=tokenizer,
                      max_pending=config.max_num_seqs + config.max_waiting, validator=validator)
