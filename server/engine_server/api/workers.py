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
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine_server.api.runner import EXIT_ENGINE_FAILED, serve_until_stopped
from engine_server.api.stream_limit import SharedStreamLimitFile
from engine_server.api.worker_metrics import WorkerScraper, answer_scrapes, merge_families, scrape_all
from engine_server.frontend.outputs import EngineState
from engine_server.frontend.types import EngineDead, EngineFactory, default_engine_factory
from engine_server.proc_title import api_worker, set_process_title

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from prometheus_client.core import Metric

    from engine_server.api.config import ServerConfig
    from engine_server.api.handle import EngineHandle
    from engine_server.api.server import EngineServer
    from engine_server.frontend.types import EngineConfig

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 300.0  # workers import the stack and load the tokenizer; two busy cores
RESTART_STABLE_S = 10.0  # a worker that lived this long is replaced at once
RESTART_DELAY_S = (1.0, 30.0)  # else after a delay doubling within these bounds


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


@dataclass(slots=True, eq=False)
class _Worker:
    """One worker process and the primary's end of its status pipe."""

    spec: WorkerSpec
    process: BaseProcess
    status: Connection  # "ready" (or why not) from the worker; then its metrics on request
    started_at: float
    scraper: WorkerScraper | None = None  # once it serves


class WorkerPool:
    """The primary's worker processes: started, watched (one that dies is logged, counted and replaced),
    scraped for metrics, stopped.

    NOTE: a worker that dies is replaced at once; one whose predecessor died too and that lived less than
    `RESTART_STABLE_S` after a delay that doubles from 1 s to 30 s, so a worker that cannot start does not
    spin. None is replaced once the engine has failed or the pool is stopping (the server is ending anyway).
    """

    def __init__(self, workers: list[_Worker], stream_limit: SharedStreamLimitFile) -> None:
        # NOTE: lists replaced, never changed in place: the metrics exporter's threads read them (`scrape`)
        self._workers = workers
        self._stream_limit = stream_limit
        self._retired: list[Metric] = []  # the last metrics of workers that died, summed: no counter drops
        self._restarts: set[asyncio.Task[None]] = set()
        self._restart_delay_s: dict[int, float] = {}
        self._supervisor: _Supervisor | None = None
        self._is_stopping = False

    @classmethod
    def spawn(cls, core_conns: list[Connection], *, port: int, server_config: ServerConfig,
              engine_config: EngineConfig, stream_limit: SharedStreamLimitFile) -> WorkerPool:
        level = logging.getLevelName(logging.getLogger("engine_server").getEffectiveLevel()).lower()
        specs = [WorkerSpec(index, port, server_config, engine_config, level, stream_limit)
                 for index in range(1, len(core_conns) + 1)]
        return cls([_start_worker(spec, conn) for spec, conn in zip(specs, core_conns, strict=True)],
                   stream_limit)

    async def wait_ready(self, *, timeout: float) -> None:  # noqa: ASYNC109 - a start budget
        """Until every worker serves; raises RuntimeError when one fails or the time is up."""
        for worker in self._workers:
            problem = await _wait_ready(worker, timeout=timeout)
            if problem is not None:
                raise RuntimeError(f"api worker {worker.spec.index} {problem}")

    def supervise(self, *, new_core_pipe: Callable[[], Connection], can_restart: Callable[[], bool],
                  on_restart: Callable[[], None]) -> None:
        """From now on, a worker that dies is replaced (see the class docstring): `new_core_pipe()` gives its
        successor a pipe to the core, `can_restart()` says whether the engine still serves, `on_restart()`
        counts each replacement."""
        self._supervisor = _Supervisor(new_core_pipe, can_restart, on_restart)
        for worker in self._workers:
            self._watch(worker)

    def _watch(self, worker: _Worker) -> None:
        # NOTE: a process's sentinel becomes readable when it ends: no thread, no polling
        asyncio.get_running_loop().add_reader(worker.process.sentinel, self._on_exit, worker)

    def _on_exit(self, worker: _Worker) -> None:
        asyncio.get_running_loop().remove_reader(worker.process.sentinel)
        if self._is_stopping:
            return
        task = asyncio.create_task(self._replace(worker), name=f"api-worker-{worker.spec.index}-restart")
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _replace(self, worker: _Worker) -> None:
        supervisor = self._supervisor
        assert supervisor is not None
        process, index = worker.process, worker.spec.index
        # NOTE: collected now (a dead worker stayed a zombie); its sentinel closes a moment before it can be
        await asyncio.to_thread(process.join, 5.0)
        how = _how_it_ended(process.exitcode)
        if worker.scraper is not None:
            self._retired = merge_families(self._retired, [worker.scraper.last])
            worker.scraper.close()
        else:
            worker.status.close()
        ended_at = time.monotonic()
        lived_s = ended_at - worker.started_at
        if process.exitcode == EXIT_ENGINE_FAILED or not supervisor.can_restart():
            logger.error("api worker %d (pid %s) %s; not replaced: the engine has failed", index, process.pid,
                         how)
            return
        previous = self._restart_delay_s.get(index)
        delay = 0.0
        if previous is not None and lived_s < RESTART_STABLE_S:
            delay = min(max(RESTART_DELAY_S[0], 2 * previous), RESTART_DELAY_S[1])
        self._restart_delay_s[index] = delay
        logger.error("api worker %d (pid %s) %s after %.1f s; starting a new one%s", index, process.pid, how,
                     lived_s, f" in {delay:.0f} s" if delay else "")
        supervisor.on_restart()
        await asyncio.sleep(delay)
        if self._is_stopping or not supervisor.can_restart():
            return
        try:
            core_conn = supervisor.new_core_pipe()
        except EngineDead as exc:
            logger.error("api worker %d not replaced: %s", index, exc)
            return
        successor = _start_worker(worker.spec, core_conn)
        self._workers = [successor if w is worker else w for w in self._workers]
        self._watch(successor)
        problem = await _wait_ready(successor, timeout=WORKER_START_TIMEOUT_S)
        if problem is not None:  # its exit (now or after this kill) is handled as any other
            logger.error("api worker %d (pid %s) %s", index, successor.process.pid, problem)
            successor.process.kill()
            return
        logger.info("api worker %d serves again (pid %s), %.1f s after its predecessor ended", index,
                    successor.process.pid, time.monotonic() - ended_at)

    async def stop(self, timeout: float) -> None:  # noqa: ASYNC109 - a drain budget
        """SIGTERM every worker (each drains for up to its --drain-timeout), wait, then kill what is left."""
        self._is_stopping = True
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)
        workers = self._workers
        if self._supervisor is not None:
            loop = asyncio.get_running_loop()
            for worker in workers:
                loop.remove_reader(worker.process.sentinel)
        for worker in workers:
            process = worker.process
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        for worker in workers:
            process = worker.process
            await asyncio.to_thread(process.join, timeout + 5.0)
            if process.is_alive():
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
        for worker in workers:
            if worker.scraper is not None:
                worker.scraper.close()
            else:
                worker.status.close()
        self._stream_limit.unlink()

    def scrape(self) -> list[list[Metric]]:
        """Every worker's metric families (its last answer where it does not answer now), and those of the
        workers that died (their last answers)."""
        workers, retired = self._workers, self._retired
        scrapers = [worker.scraper for worker in workers if worker.scraper is not None]
        return [retired, *scrape_all(scrapers)]

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process.pid is not None]


@dataclass(frozen=True, slots=True)
class _Supervisor:
    new_core_pipe: Callable[[], Connection]
    can_restart: Callable[[], bool]
    on_restart: Callable[[], None]


def _start_worker(spec: WorkerSpec, core_conn: Connection) -> _Worker:
    ctx = multiprocessing.get_context("spawn")
    status, child_status = ctx.Pipe(duplex=True)
    process = ctx.Process(target=worker_main, args=(spec, core_conn, child_status),
                          name=f"api-worker-{spec.index}", daemon=True)
    process.start()
    core_conn.close()
    child_status.close()
    return _Worker(spec, process, status, time.monotonic())


async def _wait_ready(worker: _Worker, *, timeout: float) -> str | None:  # noqa: ASYNC109 - a start budget
    """None once the worker says it serves (its scraper is set then); else what went wrong."""
    status = worker.status
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(status.fileno(), on_readable)
    try:
        await asyncio.wait_for(readable, timeout)
    except TimeoutError:
        return f"did not start within {timeout:.0f} s"
    finally:
        loop.remove_reader(status.fileno())
    try:
        message = status.recv()
    except (EOFError, OSError):
        return "exited while starting"
    if message != "ready":
        return f"failed to start: {message}"
    worker.scraper = WorkerScraper(status, index=worker.spec.index)
    return None


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"


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
        except BaseException:
            stream_limit.unlink()
            raise
        # NOTE: from here the pool unlinks the count file when it stops (a replacement worker opens it)
        engine.set_before_shutdown(pool.stop)
        try:
            await pool.wait_ready(timeout=WORKER_START_TIMEOUT_S)
        except BaseException:
            await engine.shutdown(timeout=0.0)
            raise
        metrics = server.metrics
        if metrics is not None:
            metrics.add_workers(pool.scrape)

        def count_restart() -> None:
            if metrics is not None:
                metrics.worker_restarts.inc()

        pool.supervise(new_core_pipe=engine.new_frontend_pipe,
                       can_restart=lambda: engine.state is EngineState.SERVING, on_restart=count_restart)
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

        code = uvloop.run(_serve_worker(spec, core_conn, status))
    except Exception as exc:
        logger.exception("api worker %d failed", spec.index)
        with contextlib.suppress(OSError):
            status.send(f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    sys.exit(code)


async def _serve_worker(spec: WorkerSpec, core_conn: Connection, status: Connection) -> int:
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
    # NOTE: an engine failure ends this worker too (its exit status tells the primary not to replace it)
    return await serve_until_stopped(server, stop, asyncio.Event())
