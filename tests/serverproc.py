"""Start `engine-server` in a subprocess for end-to-end tests and wait (bounded) for its ready file.

with start_server("--max-num-seqs", "8") as server:
    channel = Channel("127.0.0.1", server.port)

Several at once (their startups overlap): `start_servers(2, "--in-process-engine")`. Both are safe to call
from any thread.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

STARTUP_TIMEOUT_S = 240.0  # first start may build the tiny model; two cores shared with other test servers
STOP_TIMEOUT_S = 60.0


def _load_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:  # not Linux / no glibc: best effort only
        return None


# NOTE: resolved here, in the parent: the child runs `_die_with_parent` between fork and exec, where an import
# can deadlock on an import lock that another thread of the test process held at fork time.
_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the test process dies, so no server is orphaned.

    NOTE: the kernel sends it when the *thread* that forked the child exits, not the process: hence every
    server is forked by `_spawner()`'s one thread, which lives as long as the test process.
    """
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@functools.cache
def _spawner() -> ThreadPoolExecutor:
    """The one long-lived thread that forks every server (see `_die_with_parent`).

    NOTE: cached, not a module global: created on first use; at interpreter exit concurrent.futures joins
    the thread, and its exit SIGTERMs any server still running.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="serverproc-spawner")


def _command() -> list[str]:
    script = Path(sys.executable).parent / "engine-server"
    return [str(script)] if script.exists() else [sys.executable, "-m", "engine_server"]


def process_name(pid: int) -> str:
    """/proc/PID/comm: the server's engine core and api workers name themselves (proc_title.py)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""  # exited meanwhile


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def connection_owner(channel: Any) -> int:
    """The pid of the server process that accepted this (used) grpclib channel's connection (Linux: via
    /proc/net/tcp); with --api-workers, which frontend serves it."""
    protocol = channel._protocol  # grpclib internals: the connection of a used channel
    local_port = protocol.connection._transport.get_extra_info("sockname")[1]
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == local_port:  # remote end = our client socket
            inode = fields[9]
            break
    assert inode is not None
    target = f"socket:[{inode}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in fds):
                return int(pid)
        except OSError:
            continue
    raise AssertionError("no process owns the server end of the connection")


def _descendants(pid: int) -> list[int]:
    children = [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [found for child in children for found in (child, *_descendants(child))]


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

    def pids_named(self, name: str) -> list[int]:
        """The server's descendant processes of that name (Linux)."""
        return [pid for pid in _descendants(self.process.pid) if process_name(pid) == name]

    def pids(self) -> list[int]:
        """The server's process and all its descendants (Linux)."""
        return [self.process.pid, *_descendants(self.process.pid)]

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


class _Launch:
    """A server process that has not yet written its ready file."""

    def __init__(self, *extra_args: str, env: dict[str, str] | None) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="engine-server-"))
        self.ready = self.workdir / "ready.json"
        command = [*_command(), "--port", "0", "--ready-file", str(self.ready), *extra_args]
        self.process = spawn(command, log_path=self.log_path, env=env)

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def check_running(self) -> None:
        if self.process.poll() is not None:
            log_text = self.log_path.read_text(errors="replace")
            raise RuntimeError(
                f"engine-server exited with {self.process.returncode} before ready:\n{log_text[-4000:]}"
            )

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def running_server(self) -> RunningServer:
        info = json.loads(self.ready.read_text())
        return RunningServer(
            self.process, port=int(info["port"]), workdir=self.workdir, metrics_port=info.get("metrics_port")
        )


def spawn(
    command: list[str], *, log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start any test helper process (output to `log_path`) that must not outlive the test process."""
    return _spawner().submit(_popen, command, log_path=log_path, env=env).result()


def _popen(command: list[str], *, log_path: Path, env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )


def _wait_ready(launches: Sequence[_Launch], *, timeout: float) -> list[RunningServer]:
    """Poll every ready file (bounded by `timeout`); on any failure kill them all and raise."""
    deadline = time.monotonic() + timeout
    try:
        # NOTE: polling a file is the contract with every harness (no log scraping); bounded by `timeout`.
        while not all(launch.ready.exists() for launch in launches):
            for launch in launches:
                launch.check_running()
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine-server not ready after {timeout} s")
            time.sleep(0.05)
    except BaseException:
        for launch in launches:
            launch.kill()
        raise
    return [launch.running_server() for launch in launches]


def start_server(
    *extra_args: str, env: dict[str, str] | None = None, timeout: float = STARTUP_TIMEOUT_S
) -> RunningServer:
    """Launch `engine-server --port 0 --ready-file ...` and return once it is SERVING."""
    return _wait_ready([_Launch(*extra_args, env=env)], timeout=timeout)[0]


def start_servers(
    count: int,
    *extra_args: str,
    per_server_args: Sequence[Sequence[str]] = (),
    env: dict[str, str] | None = None,
    timeout: float = STARTUP_TIMEOUT_S,
) -> list[RunningServer]:
    """Launch `count` servers at once and return when all are SERVING (or kill them all and raise).

    Server i gets `extra_args` followed by `per_server_args[i]` (when given, one entry per server).
    """
    if per_server_args and len(per_server_args) != count:
        raise ValueError(f"per_server_args has {len(per_server_args)} entries for {count} servers")
    own_args = per_server_args or [()] * count
    launches: list[_Launch] = []
    try:
        for args in own_args:
            launches.append(_Launch(*extra_args, *args, env=env))
    except BaseException:
        for launch in launches:
            launch.kill()
        raise
    return _wait_ready(launches, timeout=timeout)
