"""--max-concurrent-streams as one count over every frontend process (api/stream_limit.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from engine_server.api.stream_limit import LocalStreamLimit, SharedStreamLimitFile, StreamSlot

TIMEOUT_S = 30.0


def test_local_limit_refuses_at_the_limit_and_frees_on_release() -> None:
    limit = LocalStreamLimit(2)
    assert [limit.try_acquire() for _ in range(3)] == [True, True, False]
    limit.release()
    assert limit.try_acquire()
    assert not limit.try_acquire()


@pytest.fixture
def shared() -> Iterator[SharedStreamLimitFile]:
    shared = SharedStreamLimitFile.create(limit=3, num_frontends=2)
    yield shared
    shared.unlink()


def test_a_slot_is_given_back_once_however_often_released() -> None:
    limit = LocalStreamLimit(2)
    first, second = StreamSlot.try_take(limit), StreamSlot.try_take(limit)
    assert first is not None
    assert second is not None
    assert StreamSlot.try_take(limit) is None
    for _ in range(3):  # the sender before the end, then the handler's finally: one place back, not three
        first.release()
    third = StreamSlot.try_take(limit)
    assert third is not None
    assert StreamSlot.try_take(limit) is None
    second.release()
    third.release()
    assert [limit.try_acquire() for _ in range(3)] == [True, True, False]


def test_shared_limit_counts_every_frontend(shared: SharedStreamLimitFile) -> None:
    primary, worker = shared.open(0), shared.open(1)
    shared.unlink()  # NOTE: views opened before the unlink keep working
    try:
        assert [primary.try_acquire(), worker.try_acquire(), worker.try_acquire()] == [True, True, True]
        assert not primary.try_acquire()
        assert not worker.try_acquire()
        assert primary.num_streams == worker.num_streams == 3
        worker.release()
        assert primary.try_acquire()
        assert not worker.try_acquire()
        for view, held in ((primary, 2), (worker, 1)):
            for _ in range(held):
                view.release()
        assert primary.num_streams == 0
    finally:
        primary.close()
        worker.close()


def _child(shared: SharedStreamLimitFile, code: str) -> subprocess.Popen[str]:
    """A process that opens frontend slot 1, runs `code` with it as `view`, says "go" and then sleeps."""
    script = (
        "import sys, time\n"
        "from engine_server.api.stream_limit import SharedStreamLimitFile\n"
        f"view = SharedStreamLimitFile({shared.path!r}, {shared.limit}, {shared.num_frontends}).open(1)\n"
        f"{code}\n"
        "print('go', flush=True)\n"
        "time.sleep(60)\n"
    )
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def _kill(child: subprocess.Popen[str]) -> None:
    """SIGKILL once it said "go"; returns once it is dead, leaving it unreaped (a zombie)."""
    assert child.stdout is not None
    assert child.stdout.readline() == "go\n"
    os.kill(child.pid, signal.SIGKILL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)


def test_streams_of_a_dead_frontend_are_reclaimed_at_the_limit(shared: SharedStreamLimitFile) -> None:
    primary = shared.open(0)
    child = _child(shared, "assert view.try_acquire() and view.try_acquire()")
    try:
        _kill(child)
        assert primary.num_streams == 2  # NOTE: a dead frontend's count stays until the limit is reached
        assert [primary.try_acquire() for _ in range(4)] == [True, True, True, False]
    finally:
        child.wait(TIMEOUT_S)
        primary.close()


def test_a_frontend_killed_inside_the_lock_does_not_wedge_the_others(shared: SharedStreamLimitFile) -> None:
    primary = shared.open(0)
    child = _child(shared, "view._locked().__enter__()")
    try:
        _kill(child)
        assert primary.try_acquire()  # the kernel dropped the dead process's flock
    finally:
        child.wait(TIMEOUT_S)
        primary.close()


def test_create_removes_the_files_of_primaries_that_are_gone() -> None:
    """A primary killed during start-up (before it unlinked it) leaves its file; the next one sweeps it."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)  # exited and reaped: no such process now
    first = SharedStreamLimitFile.create(limit=1, num_frontends=1)
    folder = os.path.dirname(first.path)
    orphan = os.path.join(folder, f"engine-streams-{dead_pid}-orphan")
    live = os.path.join(folder, f"engine-streams-{os.getpid()}-live")
    for path in (orphan, live):
        with open(path, "wb") as f:
            f.write(b"\0" * 16)
    try:
        assert os.path.basename(first.path).startswith(f"engine-streams-{os.getpid()}-")
        second = SharedStreamLimitFile.create(limit=1, num_frontends=1)
        assert not os.path.exists(orphan)
        assert os.path.exists(live)  # its primary (this process) still runs
        assert os.path.exists(first.path)
        second.unlink()
    finally:
        first.unlink()
        for path in (orphan, live):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
