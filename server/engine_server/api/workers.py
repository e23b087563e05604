"""`--api-workers N`: N gRPC frontend processes share the port (SO_REUSEPORT) and one engine core process.

The primary (the process `engine-server` started) listens first, starts the shared core, then spawns workers
1..N-1; each runs a whole EngineServer (same flags, no ready file, no metrics endpoint) on the same port with
its own pipe to the core. The kernel spreads new connections over the listeners. The primary writes the ready
file once every worker serves. On SIGTERM the primary stops the workers first (each drains its own streams
within --drain-timeout), then drains itself and stops the core.

Server-wide, whichever process serves a connection: --max-concurrent-streams counts the streams of every
frontend (api/stream_limit.py), and the primary's --metrics-port reports every frontend's counters, asking
each worker over its status pipe at scrape time (api/worker_metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine_server.api.stream_limit import SharedStreamLimitFile
from engine_server.api.worker_metrics import WorkerScraper, answer_scrapes, scrape_all
from engine_server.frontend.core_loop import EngineFactory, default_engine_factory
from engine_server.proc_title import api_worker, set_process_title

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from prometheus_client.core import Metric

    from engine_server.api.config import ServerConfig
    from engine_server.api.handle import EngineHandle
    from engine_server.api.server import EngineServer
    from engine_server.engine.config import EngineConfig

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 300.0  # workers import the stack and load the tokenizer; two busy cores


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    index: int
    port: int
    server_config: ServerConfig
    engine_config: EngineConfig
    log_level: str
    stream_limit: SharedStreamLimitFile

    def __post_init__(self) -> None:
        if self.index < 1:
            raise ValueError(f"index: workers are numbered from 1, got {self.index}")


class WorkerPool:
    """The primary's view of its worker processes."""

    def __init__(self, processes: Sequence[BaseProcess], statuses: list[Connection]) -> None:
        self._processes = processes
        self._statuses = statuses  # "ready" (or why not) from each worker; then its metrics on request
        self._scrapers = [WorkerScraper(status, index=i) for i, status in enumerate(statuses, start=1)]

    @classmethod
    def spawn(cls, core_conns: list[Connection], *, port: int, server_config: ServerConfig,
              engine_config: EngineConfig, stream_limit: SharedStreamLimitFile) -> WorkerPool:
        ctx = multiprocessing.get_context("spawn")
        level = logging.getLevelName(logging.getLogger("engine_server").getEffectiveLevel()).lower()
        processes, statuses = [], []
        for index, core_conn in enumerate(core_conns, start=1):
            status, child_status = ctx.Pipe(duplex=True)
            spec = WorkerSpec(index, port, server_config, engine_config, level, stream_limit)
            process = ctx.Process(target=worker_main, args=(spec, core_conn, child_status),
                                  name=f"api-worker-{index}", daemon=True)
            process.start()
            core_conn.close()
            child_status.close()
            processes.append(process)
            statuses.append(status)
        return cls(processes, statuses)

    async def wait_ready(self, *, timeout: float) -> None:  # noqa: ASYNC109 - a start budget
        """Until every worker serves; raises RuntimeError when one fails or the time is up."""
        for index, status in enumerate(self._statuses, start=1):
            if not await asyncio.to_thread(status.poll, timeout):
                raise RuntimeError(f"api worker {index} did not start within {timeout:.0f} s")
            try:
                message = status.recv()
            except EOFError:
                raise RuntimeError(f"api worker {index} exited while starting") from None
            if message != "ready":
                raise RuntimeError(f"api worker {index} failed to start: {message}")

    async def stop(self, timeout: float) -> None:  # noqa: ASYNC109 - a drain budget
        """SIGTERM every worker (each drains for up to its --drain-timeout), wait, then kill what is left."""
        for process in self._processes:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        for process in self._processes:
            await asyncio.to_thread(process.join, timeout + 5.0)
            if process.is_alive():
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
        for scraper in self._scrapers:
            scraper.close()

    def scrape(self) -> list[list[Metric]]:
        """Every worker's metric families (its last answer where it does not answer now)."""
        return scrape_all(self._scrapers)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes if p.pid is not None]


def scale_out_starter(
    server_config: ServerConfig, engine_config: EngineConfig, *, get_server: Callable[[], EngineServer],
    engine_factory: EngineFactory = default_engine_factory,
) -> Callable[[], Awaitable[EngineHandle]]:
    """The primary's engine starter: shared core, then the workers (the primary already listens)."""

    async def start() -> EngineHandle:
        from engine_server.frontend.scale_out import start_shared_core

        server = get_server()
        stream_limit = SharedStreamLimitFile.create(limit=server_config.max_concurrent_streams,
                                                    num_frontends=server_config.api_workers)
        try:
            server.use_stream_limit(stream_limit.open(0))
            engine, conns = await start_shared_core(
                engine_config, num_frontends=server_config.api_workers, engine_factory=engine_factory
            )
            pool = WorkerPool.spawn(conns, port=server.port, server_config=server_config,
                                    engine_config=engine_config, stream_limit=stream_limit)
            engine.set_before_shutdown(pool.stop)
            try:
                await pool.wait_ready(timeout=WORKER_START_TIMEOUT_S)
            except BaseException:
                await engine.shutdown(timeout=0.0)
                raise
        finally:
            stream_limit.unlink()  # every frontend has it open by now (or the start failed)
        if server.metrics is not None:
            server.metrics.add_workers(pool.scrape)
        logger.info("%d api workers serving (pids %s)", len(conns), pool.pids)
        return engine

    return start


def worker_main(spec: WorkerSpec, core_conn: Connection, status: Connection) -> None:
    """Entry point of a worker process."""
    set_process_title(api_worker(spec.index))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the primary stops us
    logging.basicConfig(level=spec.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [worker {spec.index}] %(name)s: %(message)s")
    try:
        import uvloop

        uvloop.run(_serve_worker(spec, core_conn, status))
    except Exception as exc:
        logger.exception("api worker %d failed", spec.index)
        with contextlib.suppress(OSError):
            status.send(f"{type(exc).__name__}: {exc}")
        sys.exit(1)


async def _serve_worker(spec: WorkerSpec, core_conn: Connection, status: Connection) -> None:
    from engine_server.api.metrics import ServerMetrics
    from engine_server.api.server import EngineServer
    from engine_server.frontend.scale_out import attach_engine
    from engine_server.gc_policy import freeze_startup_heap

    config = dataclasses.replace(spec.server_config, port=spec.port, ready_file=None, metrics_port=None)

    async def start_engine() -> EngineHandle:
        return await attach_engine(core_conn, spec.engine_config)

    # NOTE: metrics collected here, served by the primary (which asks over `status`), not on a port of ours.
    metrics = ServerMetrics() if spec.server_config.metrics_port is not None else None
    server = EngineServer(config, engine_config=spec.engine_config, start_engine=start_engine,
                          metrics=metrics)
    server.use_stream_limit(spec.stream_limit.open(spec.index))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await server.start()
    except BaseException:
        await server.close()
        raise
    freeze_startup_heap()
    status.send("ready")
    if metrics is not None:
        answer_scrapes(status, metrics.registry, index=spec.index)
    await stop.wait()
    await server.drain()
