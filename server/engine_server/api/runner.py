"""Runs an EngineServer until SIGTERM/SIGINT: a graceful drain on the first signal, a hard stop on the second.

Exit codes: 0 after a graceful stop, 1 when the server could not start or was stopped by a second signal,
3 (EXIT_ENGINE_FAILED) when the engine failed (its core process died): the calls in flight end with
UNAVAILABLE, then the server stops at once (also when it was draining already), so that its supervisor
(Kubernetes, systemd) starts a new one. A failed engine never recovers: staying up would hold the port with
nothing behind it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

from engine_server.api.server import EngineServer, EngineStarter, default_engine_starter
from engine_server.frontend.types import EngineFactory, default_engine_factory
from engine_server.gc_policy import freeze_startup_heap

if TYPE_CHECKING:
    from engine_server.api.config import ServerConfig
    from engine_server.frontend.types import EngineConfig

logger = logging.getLogger("engine_server")

EXIT_ENGINE_FAILED = 3


async def serve(
    server_config: ServerConfig, engine_config: EngineConfig, *, engine_factory: EngineFactory | None = None
) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code. `engine_factory`: LLMEngine unless given."""
    start_engine: EngineStarter
    if server_config.api_workers > 1:
        from engine_server.api.workers import scale_out_starter

        start_engine = scale_out_starter(server_config, engine_config, get_server=lambda: server,
                                         engine_factory=engine_factory or default_engine_factory)
    else:
        start_engine = default_engine_starter(engine_config, in_process=server_config.in_process_engine,
                                              engine_factory=engine_factory)
    server = EngineServer(server_config, engine_config=engine_config, start_engine=start_engine)
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            logger.warning("%s again: stopping now", signal.Signals(signum).name)
            force.set()
        else:
            logger.info("%s: draining (send it again to stop at once)", signal.Signals(signum).name)
            stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    starting = asyncio.create_task(server.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # a signal while loading: nothing to drain
        starting.cancel()
        await server.close()
        return 0
    if starting.exception() is not None:
        stopping.cancel()
        exc = starting.exception()
        logger.debug("start failed", exc_info=exc)
        print(f"engine-server: error: {exc}", file=sys.stderr)
        await server.close()
        return 1
    stopping.cancel()
    freeze_startup_heap()
    return await serve_until_stopped(server, stop, force)


async def serve_until_stopped(server: EngineServer, stop: asyncio.Event, force: asyncio.Event) -> int:
    """A started server serves until `stop` is set (then it drains; `force` set meanwhile stops it at once) or
    its engine fails (then it stops at once); returns the exit code. (The primary's and each --api-workers
    worker's life after start.)"""
    stopping = asyncio.create_task(stop.wait())
    failing = asyncio.create_task(server.wait_engine_failed())
    await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
    if not stopping.done():
        stopping.cancel()
        logger.error("the engine failed: stopping (exit status %d) for a supervisor to start a new server",
                     EXIT_ENGINE_FAILED)
        await server.stop_after_failure()
        return EXIT_ENGINE_FAILED
    failing.cancel()
    draining = asyncio.create_task(server.drain())
    forced = asyncio.create_task(force.wait())
    await asyncio.wait({draining, forced}, return_when=asyncio.FIRST_COMPLETED)
    if draining.done():
        forced.cancel()
        draining.result()
        # NOTE: an engine that failed during the drain is a failure all the same
        return EXIT_ENGINE_FAILED if server.has_engine_failed else 0
    draining.cancel()
    await server.close()
    return 1


def run(
    server_config: ServerConfig, engine_config: EngineConfig, *, engine_factory: EngineFactory | None = None
) -> int:
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(serve(server_config, engine_config, engine_factory=engine_factory))
