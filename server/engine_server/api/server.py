"""Assembles the gRPC server (engine service, health, reflection, security, metrics) and runs its life cycle.

1) listen (health NOT_SERVING, calls UNAVAILABLE) -> 2) start the engine -> 3) warm up with one tiny
request -> 4) SERVING + ready file -> 5) drain on request: NOT_SERVING, new calls UNAVAILABLE, in-flight
streams finish within the drain timeout, the rest are aborted (finish reason ABORT); each HTTP/2 connection
gets GOAWAY(NO_ERROR) once it has no call open -> 6) close.
An engine that fails (its core process died) ends every call in flight with UNAVAILABLE; `wait_engine_failed`
tells the owner, which stops the server (`stop_after_failure`): a failed engine never comes back, so the
process must end for its supervisor to start a new one (api/runner.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_proto.engine.v1 import info_pb2
from grpclib.reflection.service import ServerReflection

from engine_server.api.health import build_health
from engine_server.api.in_flight import InFlight
from engine_server.api.metrics import ServerMetrics
from engine_server.api.security import build_server
from engine_server.api.security.metrics import register_guard_metrics
from engine_server.api.servicer import EngineServicer
from engine_server.api.stream_limit import LocalStreamLimit
from engine_server.api.transport.fast_path import FastPathHandler
from engine_server.api.vllm_compat import SERVICE_NAME as VLLM_SERVICE
from engine_server.api.vllm_compat import VllmCompatOptions, VllmEngineServicer
from engine_server.frontend.outputs import EngineState, GenerateRequest
from engine_server.frontend.types import SamplingParams

if TYPE_CHECKING:
    from engine_server.api.config import ServerConfig
    from engine_server.api.handle import EngineHandle
    from engine_server.api.security import GuardedServer
    from engine_server.api.stream_limit import StreamLimit
    from engine_server.frontend.types import EngineConfig, EngineFactory

logger = logging.getLogger(__name__)

EngineStarter = Callable[[], Awaitable["EngineHandle"]]
# The streaming calls worth transport/fast_path.py (the gateway's and ours); any other takes grpclib's path.
_FAST_METHODS = (EngineServicer.GENERATE_PATH, f"/{VLLM_SERVICE}/Generate")
_HANDLER_GRACE_S = 5.0  # after the engine drained: time for handlers to flush their last messages


def _listen_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    # NOTE: reuse_port with --api-workers: every frontend process listens on the same port.
    return socket.create_server((host, port), family=family, backlog=1024, reuse_port=reuse_port)


def write_ready_file(path: str, *, port: int, metrics_port: int | None = None) -> None:
    """Atomically (write + rename), so a harness polling for the file never reads half of it."""
    target = Path(path)
    content: dict[str, int] = {"port": port, "pid": os.getpid()}
    if metrics_port is not None:
        content["metrics_port"] = metrics_port
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(content, f)
    os.replace(tmp, target)


class EngineServer:
    """One server: `await start()`, then `await drain()` (graceful) or `await close()` (at once)."""

    def __init__(
        self, config: ServerConfig, *, engine_config: EngineConfig, start_engine: EngineStarter,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.config = config
        self._engine_config = engine_config
        self._start_engine = start_engine
        self._engine: EngineHandle | None = None
        # NOTE: `metrics` without a metrics_port: an --api-workers worker, which the primary scrapes.
        self.metrics = metrics or (ServerMetrics() if config.metrics_port is not None else None)
        name = config.served_model_name or Path(engine_config.model).name
        # NOTE: one count of Generate handlers for both services: what a drain waits for before closing.
        self._in_flight = InFlight()
        self.servicer = EngineServicer(
            served_model_name=name, max_concurrent_streams=config.max_concurrent_streams,
            metrics=self.metrics, in_flight=self._in_flight,
        )
        self.servicer.adapter_admin = config.adapter_admin
        self.health, self._check = build_health(self.servicer, is_serving=self._is_serving,
                                                is_alive=self._is_alive)
        # vllm.grpc.engine.VllmEngine on the same port: the smg gateway's worker protocol (docs/deploy.md).
        self.vllm_servicer = VllmEngineServicer(
            options=VllmCompatOptions(served_model_name=name, max_num_seqs=engine_config.max_num_seqs),
            is_ready=self._is_serving, metrics=self.metrics, in_flight=self._in_flight,
        )
        self.use_stream_limit(LocalStreamLimit(config.max_concurrent_streams))
        handlers: list[Any] = [self.servicer, self.health, self.vllm_servicer]
        if config.enable_reflection:
            handlers = ServerReflection.extend(handlers)
        self._server: GuardedServer = build_server(
            handlers, config.security,
            handler_factory=functools.partial(
                FastPathHandler, fast_methods=_FAST_METHODS,
                direct={EngineServicer.GENERATE_PATH: self.servicer.start_generate,
                        f"/{VLLM_SERVICE}/Generate": self.vllm_servicer.start_generate},
            ),
        )
        if self.metrics is not None:
            self.metrics.install(self._server)
            register_guard_metrics(self.metrics.registry, self._server.guard_stats)
            self.metrics.watch_load(lambda: self._engine.stats() if self._engine is not None else None)
            self.metrics.watch_core(lambda: self._engine.core_pid if self._engine is not None else None)
        self.port = 0
        self.metrics_port: int | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._engine_failed = asyncio.Event()

    def use_stream_limit(self, stream_limit: StreamLimit) -> None:
        """--max-concurrent-streams counts engine.v1 and vLLM Generate streams together, in one object
        (--api-workers: shared by every frontend process); set before the engine is attached."""
        self.servicer.use_stream_limit(stream_limit)
        self.vllm_servicer.use_stream_limit(stream_limit)

    def _is_serving(self) -> bool:
        return self.servicer.state == info_pb2.ENGINE_STATE_SERVING

    def _is_alive(self) -> bool:
        return self.servicer.state != info_pb2.ENGINE_STATE_FAILED

    async def start(self) -> None:
        cfg = self.config
        sock = _listen_socket(cfg.host, cfg.port, reuse_port=cfg.api_workers > 1)
        self.port = sock.getsockname()[1]
        await self._server.start(sock=sock, ssl=cfg.security.server_ssl_context())
        logger.info("listening on %s:%d (health NOT_SERVING until the model is loaded)", cfg.host, self.port)
        if self.metrics is not None and cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(host=cfg.host, port=cfg.metrics_port)
            logger.info("metrics on http://%s:%d/metrics", cfg.host, self.metrics_port)
        started = time.monotonic()
        engine = self._engine = await self._start_engine()
        info = engine.model_info
        logger.info("model loaded in %.1f s: %s (%s, %s on %s, %d KV blocks of %d tokens)",
                    time.monotonic() - started, info.model_path, info.architecture, info.dtype, info.device,
                    info.num_kv_blocks, info.block_size)
        self.servicer.attach(engine, limits=self._limits(engine))
        self.vllm_servicer.attach(engine)
        engine.add_state_listener(self._on_engine_state)
        await self._warm_up(engine)
        self.servicer.set_ready()
        self._check.refresh()
        self._monitor = asyncio.create_task(self._watch_engine(), name="engine-health-monitor")
        if cfg.ready_file is not None:
            write_ready_file(cfg.ready_file, port=self.port, metrics_port=self.metrics_port)
        logger.info("SERVING %s on %s:%d", info.model_path, cfg.host, self.port)

    def _limits(self, engine: EngineHandle) -> info_pb2.ServerLimits:
        ec = self._engine_config
        return info_pb2.ServerLimits(
            max_model_len=engine.model_info.max_model_len,
            max_num_seqs=ec.max_num_seqs,
            max_waiting_requests=ec.max_waiting,
            max_concurrent_streams=self.config.security.h2.max_concurrent_streams,
            max_receive_message_bytes=self.config.security.max_receive_message_size,
            kv_block_size=engine.model_info.block_size,
            max_num_batched_tokens=ec.max_num_batched_tokens,
            max_adapters=ec.max_adapters,
            max_lora_rank=ec.max_lora_rank if ec.max_adapters else 0,
        )

    async def _warm_up(self, engine: EngineHandle) -> None:
        """One tiny request through the whole engine path, so the first client does not pay for it."""
        started = time.monotonic()
        info = engine.model_info
        token_id = info.bos_token_id if info.bos_token_id is not None else 0
        if info.task == "embed":
            await engine.embed([[token_id, token_id]], normalize=True)
        else:
            request = GenerateRequest(
                request_id=f"warmup-{uuid.uuid4().hex}", prompt_token_ids=(token_id,) * 4,
                params=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            )
            async with contextlib.aclosing(engine.generate(request)) as outputs:
                async for _ in outputs:
                    pass
        logger.info("warm-up done in %.2f s", time.monotonic() - started)

    def _on_engine_state(self, state: EngineState) -> None:
        self._check.refresh()  # health Watch streams learn it now (Check reads the state live)
        if state is EngineState.FAILED:
            self._engine_failed.set()

    async def _watch_engine(self) -> None:
        """Notices an engine failure that no state listener reported (a handle that has none to call)."""
        while True:
            self._check.refresh()
            if self._engine is not None and self._engine.state is EngineState.FAILED:
                self._engine_failed.set()
            await asyncio.sleep(1.0)

    @property
    def has_engine_failed(self) -> bool:
        return self._engine_failed.is_set()

    async def wait_engine_failed(self) -> None:
        """Returns once the engine has failed (never, while it serves); then call `stop_after_failure`."""
        await self._engine_failed.wait()

    async def stop_after_failure(self) -> None:
        """The engine failed: its calls in flight have their error (UNAVAILABLE); give their handlers a moment
        to send it, then close (each idle connection gets GOAWAY first, so clients go elsewhere)."""
        self.servicer.begin_drain()
        self._check.refresh()
        self._server.begin_drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._in_flight.wait_idle(), _HANDLER_GRACE_S)
        await self.close()

    async def drain(self) -> None:
        """Graceful stop: NOT_SERVING, refuse new calls, let in-flight streams finish, abort the rest."""
        timeout = self.config.drain_timeout_s
        self.servicer.begin_drain()
        self._check.refresh()
        # HTTP/2 GOAWAY(NO_ERROR) to each connection once it has no call open (idle ones now), so clients
        # open their next calls elsewhere instead of getting UNAVAILABLE here.
        self._server.begin_drain()
        logger.info("draining: %d streams in flight, up to %.1f s", self._in_flight.count, timeout)
        engine = self._engine
        if engine is not None:
            engine.begin_drain()
            # NOTE: shutdown waits for in-flight requests, aborts what is left at the timeout (their streams
            # end with finish reason ABORT), then stops the engine core.
            await engine.shutdown(timeout=timeout)
        with contextlib.suppress(TimeoutError):  # both services' Generate handlers send their last messages
            await asyncio.wait_for(self._in_flight.wait_idle(), _HANDLER_GRACE_S)
        await self.close()

    async def close(self) -> None:
        """Stop at once: cancel every call, stop the engine without waiting."""
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
        self.servicer.begin_drain()
        self._check.refresh()
        with contextlib.suppress(RuntimeError):  # not started
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), _HANDLER_GRACE_S)
        if self._engine is not None:
            await self._engine.shutdown(timeout=0.0)
        if self.metrics is not None:
            self.metrics.close()
        logger.info("server stopped")


def default_engine_starter(
    engine_config: EngineConfig, *, in_process: bool, engine_factory: EngineFactory | None = None
) -> EngineStarter:
    async def start() -> EngineHandle:
        from engine_server.frontend.async_engine import AsyncEngine

        if engine_factory is None:
            return await AsyncEngine.start(engine_config, in_process=in_process)
        return await AsyncEngine.start(engine_config, in_process=in_process, engine_factory=engine_factory)

    return start
