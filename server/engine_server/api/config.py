"""ServerConfig: how the gRPC server listens, limits and stops (the engine has its own EngineConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine_server.api.adapters import AdapterAdmin
from engine_server.api.security.config import SecurityConfig


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port (the ready file says which)
    served_model_name: str = ""  # "" = the model directory's name
    # Generate streams in flight on the whole server; beyond it RESOURCE_EXHAUSTED. The HTTP/2 per-connection
    # limit is security.h2.max_concurrent_streams.
    max_concurrent_streams: int = 1024
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight streams get this long to finish, then are aborted
    enable_reflection: bool = True
    metrics_port: int | None = None  # None = no metrics endpoint; 0 = any free port
    ready_file: str | None = None  # JSON {"port": N, "pid": P}, written atomically once SERVING
    in_process_engine: bool = False  # the engine core on a thread instead of its own process
    api_workers: int = 1  # frontend processes sharing the port (SO_REUSEPORT) over one engine core
    security: SecurityConfig = field(default_factory=SecurityConfig)
    adapter_admin: AdapterAdmin = field(default_factory=AdapterAdmin)  # LoadAdapter & co (api/adapters.py)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host: must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams: must be >= 1, got {self.max_concurrent_streams}")
        if not math.isfinite(self.drain_timeout_s) or self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout: must be >= 0 seconds, got {self.drain_timeout_s}")
        admin = self.adapter_admin
        if admin.enabled and self.security.api_key is not None and admin.admin_key is None:
            raise ValueError("enable_adapter_admin: a server with API keys needs an admin key for adapter "
                             "management (--admin-key or --admin-key-file)")
        if self.api_workers < 1:
            raise ValueError(f"api_workers: must be >= 1, got {self.api_workers}")
        if self.api_workers > 1 and self.in_process_engine:
            raise ValueError("api_workers: several frontend processes need the engine core in its own "
                             "process (drop --in-process-engine)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: must be in [0, 65535], got {self.metrics_port}")
