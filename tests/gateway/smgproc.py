"""Start the smg gateway (PyPI `smg`) for end-to-end tests: loopback only, bounded waits, always stopped."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from serverproc import spawn

STARTUP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    # NOTE: smg takes no port 0; a just-released ephemeral port is free in practice on loopback.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def smg_command() -> list[str]:
    script = Path(sys.executable).parent / "smg"
    if not script.exists():
        raise FileNotFoundError("smg is not installed in this venv (requirements-dev.txt pins smg)")
    return [str(script)]


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON events of an OpenAI server-sent-event stream, up to `[DONE]`."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class RunningGateway:
    def __init__(self, process: subprocess.Popen[bytes], *, port: int, log_path: Path,
                 metrics_port: int = 0) -> None:
        self.process = process
        self.port = port
        self.log_path = log_path
        self.metrics_port = metrics_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """smg's Prometheus samples, "name{labels}" -> value."""
        reply = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5.0)
        reply.raise_for_status()
        samples: dict[str, float] = {}
        for line in reply.text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def workers(self) -> list[dict[str, Any]]:
        reply = httpx.get(f"{self.url}/workers", timeout=5.0)
        reply.raise_for_status()
        workers: list[dict[str, Any]] = reply.json()["workers"]
        return workers

    def wait_for_workers(self, count: int, *, timeout: float = STARTUP_TIMEOUT_S) -> list[dict[str, Any]]:
        """Poll GET /workers (bounded) until `count` workers are registered, healthy and ready."""
        deadline = time.monotonic() + timeout
        workers: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"smg exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                workers = self.workers()
            except httpx.HTTPError:
                workers = []  # not listening yet
            ready = [w for w in workers if w.get("is_healthy") and w.get("status") == "ready"]
            if len(ready) >= count:
                return workers
            time.sleep(0.2)
        raise TimeoutError(f"smg did not list {count} healthy workers in {timeout} s: {workers}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)

    def __enter__(self) -> RunningGateway:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_gateway(worker_targets: list[str], *extra_args: str, policy: str = "round_robin") -> RunningGateway:
    """`smg launch` on 127.0.0.1 (HTTP and Prometheus), routing to grpc:// workers; returns once listening."""
    port, metrics_port = free_port(), free_port()
    log_path = Path(tempfile.mkdtemp(prefix="smg-")) / "smg.log"
    command = [
        *smg_command(), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-urls", *(f"grpc://{target}" for target in worker_targets),
        "--policy", policy,
        # Notice a dead worker within seconds (defaults: 60 s interval, 3 failures) and stop promptly.
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
        "--health-check-timeout-secs", "2",
        "--shutdown-grace-period-secs", "1", "--log-level", "warn",
        *extra_args,
    ]
    process = spawn(command, log_path=log_path)  # SIGTERM if the test process dies: no orphaned gateway
    return RunningGateway(process, port=port, log_path=log_path, metrics_port=metrics_port)
