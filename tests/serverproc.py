"""Start `engine-server` in a subprocess for end-to-end tests and wait (bounded) for its ready file.

with start_server("--max-num-seqs", "8") as server:
    channel = Channel("127.0.0.1", server.port)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

STARTUP_TIMEOUT_S = 240.0  # first start may build the tiny model; two cores shared with other test servers
STOP_TIMEOUT_S = 60.0


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the test process dies, so no server is orphaned."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not Linux / no glibc: best effort only
        pass


def _command() -> list[str]:
    script = Path(sys.executable).parent / "engine-server"
    return [str(script)] if script.exists() else [sys.executable, "-m", "engine_server"]


class RunningServer:
    def __init__(
        self, process: subprocess.Popen[bytes], *, port: int, workdir: Path, metrics_port: int | None = None
    ) -> None:
        self.process = process
        self.port = port
        self.metrics_port = metrics_port  # set when started with --metrics-port
        self.workdir = workdir
        self.returncode: int | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send_signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int:
        self.returncode = self.process.wait(timeout)
        return self.returncode

    def stop(self, signum: int = signal.SIGTERM, *, timeout: float = STOP_TIMEOUT_S) -> int:
        """Signal the server and wait for it to exit; returns its exit code (SIGKILL after `timeout`)."""
        self.send_signal(signum)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.wait(10)
            raise

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.process.poll() is None:
            self.stop()


def start_server(
    *extra_args: str, env: dict[str, str] | None = None, timeout: float = STARTUP_TIMEOUT_S
) -> RunningServer:
    """Launch `engine-server --port 0 --ready-file ...` and return once it is SERVING."""
    workdir = Path(tempfile.mkdtemp(prefix="engine-server-"))
    ready = workdir / "ready.json"
    full_env = {**os.environ, **(env or {})}
    with (workdir / "server.log").open("wb") as log:
        process = subprocess.Popen(
            [*_command(), "--port", "0", "--ready-file", str(ready), *extra_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    deadline = time.monotonic() + timeout
    # NOTE: polling a file is the contract with every harness (no log scraping); bounded by `timeout`.
    while not ready.exists():
        if process.poll() is not None:
            log_text = (workdir / "server.log").read_text(errors="replace")
            raise RuntimeError(
                f"engine-server exited with {process.returncode} before ready:\n{log_text[-4000:]}"
            )
        if time.monotonic() > deadline:
            process.kill()
            process.wait(10)
            raise TimeoutError(f"engine-server not ready after {timeout} s")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return RunningServer(
        process, port=int(info["port"]), workdir=workdir, metrics_port=info.get("metrics_port")
    )
