"""`--max-concurrent-streams`: the server-wide count of Generate streams, one process or all --api-workers.

One process: a plain counter. Several frontend processes (`SharedStreamLimit`): a small file in shared memory
holds one slot per frontend, (pid, streams in flight); each frontend writes only its own slot, and the
check-and-increment of an admission runs under `flock`, so the sum over all slots never passes the limit
whichever process the kernel gave the connection to. NOTE: flock, not a multiprocessing lock: the kernel
drops a flock when its holder dies, so a worker killed inside the critical section cannot wedge the others.
A worker that dies with streams in flight leaves its count behind; the next admission that finds the limit
reached zeroes the slots of processes that are gone (`_reclaim_dead`), so nothing leaks for good.
The file's name carries the creating primary's pid; a primary killed before it unlinked the file (during
start-up) leaves it behind, and the next `create` on the machine removes the files of primaries that are gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

_SLOT_WORDS = 2  # (pid, num_streams) per frontend, int64 each
_WORD_BYTES = 8
_PREFIX = "engine-streams-"  # + "<primary pid>-" + a random part


class StreamLimit(Protocol):
    """What the servicer asks before it admits a Generate stream and tells when the stream ends."""

    @property
    def limit(self) -> int: ...

    def try_acquire(self) -> bool:
        """One more stream, unless the limit is reached (then False and nothing changes)."""
        ...

    def release(self) -> None: ...


class StreamSlot:
    """One admitted stream's place under the limit, given back exactly once, by whichever comes first.

    NOTE: the push path writes a call's end from the engine's output task, well before the handler wakes up
    and returns; a client that opens its next stream as soon as it reads that end (on this frontend or on
    another) must find the place free, so the sender gives it back before the end leaves
    (`FastSender(before_end=...)`) and the handler's `finally` only in the other cases.
    """

    __slots__ = ("_limit",)

    def __init__(self, limit: StreamLimit) -> None:
        self._limit: StreamLimit | None = limit

    @classmethod
    def try_take(cls, limit: StreamLimit) -> StreamSlot | None:
        """A place, unless the limit is reached."""
        return cls(limit) if limit.try_acquire() else None

    def release(self) -> None:
        limit = self._limit
        if limit is not None:
            self._limit = None
            limit.release()


class LocalStreamLimit:
    """The single-process limit: a counter on the event loop's thread."""

    __slots__ = ("_limit", "_num_streams")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit: must be >= 1, got {limit}")
        self._limit = limit
        self._num_streams = 0

    @property
    def limit(self) -> int:
        return self._limit

    def try_acquire(self) -> bool:
        if self._num_streams >= self._limit:
            return False
        self._num_streams += 1
        return True

    def release(self) -> None:
        self._num_streams -= 1


@dataclass(frozen=True, slots=True)
class SharedStreamLimitFile:
    """Where the shared counts live; picklable, so the primary hands it to its workers (spawn)."""

    path: str
    limit: int
    num_frontends: int

    @classmethod
    def create(cls, *, limit: int, num_frontends: int) -> SharedStreamLimitFile:
        """A zeroed file in /dev/shm (RAM) where there is one; `unlink` it once every frontend opened it."""
        if limit < 1:
            raise ValueError(f"limit: must be >= 1, got {limit}")
        if num_frontends < 1:
            raise ValueError(f"num_frontends: must be >= 1, got {num_frontends}")
        shm = Path("/dev/shm")
        folder = shm if shm.is_dir() else Path(tempfile.gettempdir())
        _remove_orphans(folder)
        fd, path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=folder)
        try:
            os.ftruncate(fd, num_frontends * _SLOT_WORDS * _WORD_BYTES)
        finally:
            os.close(fd)
        return cls(path, limit, num_frontends)

    def open(self, index: int) -> SharedStreamLimit:
        """Frontend `index`'s view (0 = the primary); claims its slot for this process."""
        return SharedStreamLimit(self, index)

    def unlink(self) -> None:
        """The open views keep working (they hold the file); only the name goes."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class SharedStreamLimit:
    """One frontend's view of the server-wide count (see the module docstring)."""

    def __init__(self, shared: SharedStreamLimitFile, index: int) -> None:
        if not 0 <= index < shared.num_frontends:
            raise ValueError(f"index: must be in [0, {shared.num_frontends}), got {index}")
        self._limit = shared.limit
        self._num_slots = shared.num_frontends
        self._index = index
        self._fd = os.open(shared.path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, shared.num_frontends * _SLOT_WORDS * _WORD_BYTES)
        self._words = memoryview(self._map).cast("q")
        with self._locked():
            self._words[index * _SLOT_WORDS] = os.getpid()
            self._words[index * _SLOT_WORDS + 1] = 0

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def num_streams(self) -> int:
        """Streams in flight on every frontend together."""
        with self._locked():
            return self._total()

    def try_acquire(self) -> bool:
        with self._locked():
            total = self._total()
            if total >= self._limit:
                # NOTE: only at the limit: the liveness checks stay off the hot path
                total -= self._reclaim_dead()
                if total >= self._limit:
                    return False
            self._words[self._index * _SLOT_WORDS + 1] += 1
            return True

    def release(self) -> None:
        with self._locked():
            self._words[self._index * _SLOT_WORDS + 1] -= 1

    def close(self) -> None:
        self._words.release()
        self._map.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _total(self) -> int:
        words = self._words
        return sum(words[slot * _SLOT_WORDS + 1] for slot in range(self._num_slots))

    def _reclaim_dead(self) -> int:
        """Zero the counts of frontends whose process is gone; returns how many streams that freed."""
        freed = 0
        words = self._words
        for slot in range(self._num_slots):
            pid, count = words[slot * _SLOT_WORDS], words[slot * _SLOT_WORDS + 1]
            if slot != self._index and count != 0 and not _is_running(pid):
                words[slot * _SLOT_WORDS + 1] = 0
                freed += count
        return freed


def _remove_orphans(folder: Path) -> None:
    """Deletes the count files of primaries that died before they unlinked theirs."""
    for path in folder.glob(f"{_PREFIX}*-*"):
        pid = path.name.removeprefix(_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _is_running(int(pid)):
            with contextlib.suppress(OSError):  # another primary's sweep got it first, or not ours to delete
                path.unlink()


def _is_running(pid: int) -> bool:
    """Alive and not a zombie (a crashed worker stays one until the primary reaps it)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs: trust kill(0)
    return state not in ("Z", "X")
