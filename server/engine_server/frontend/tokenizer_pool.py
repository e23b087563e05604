"""`TokenizerPool`: tokenizer work (encode, chat templates, decode) off the frontend's event loop.

A few threads and a bounded number of jobs: past `max_pending` jobs queued or running, `run` raises
EngineOverloaded (RESOURCE_EXHAUSTED) at once. The Rust tokenizer releases the GIL in its batch calls
(`Tokenizer.encode`, `encode_ids` and `decode` use them), so a long text tokenized on a worker leaves the loop
free to serve everyone else. Short inputs run inline: a hop to a thread and back costs more loop time than
tokenizing them (and they never queue behind long ones).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from engine_server.engine.types import EngineOverloaded

_T = TypeVar("_T")

# NOTE: measured with the tiny tokenizer (natural text, uvloop): a 40-byte prompt costs the loop 14 us
# inline, 27 us through a worker (submit, wake-up, result) and 66 us of latency instead of 14; 512 bytes cost
# 111 us inline, 48 us of the loop and 223 us of latency through a worker. Up to 1 KiB (~250 tokens: most
# prompts) the loop's time stays small (0.2 ms; ~1 ms for random characters), no worker's CPU is spent on
# top, and a short prompt never waits behind long texts in the queue.
INLINE_MAX_BYTES = 1024
NUM_THREADS = 2
# NOTE: bounded in bytes of text, not in jobs: 64 streams' first prompts arrive at once, while a few texts of
# MBs are seconds of work. 16 MiB is ~3-8 s of tokenizing for two threads (0.2-0.5 us a byte).
MAX_PENDING_BYTES = 16 << 20


class TokenizerPool:
    """Runs `job()` inline when its input is short, else on a worker thread; bounded (EngineOverloaded)."""

    __slots__ = (
        "_executor", "_lock", "_pending_bytes", "inline_max_bytes", "max_pending_bytes", "num_threads",
    )

    def __init__(self, *, num_threads: int = NUM_THREADS, max_pending_bytes: int = MAX_PENDING_BYTES,
                 inline_max_bytes: int = INLINE_MAX_BYTES) -> None:
        if num_threads < 1 or max_pending_bytes < 1 or inline_max_bytes < 0:
            raise ValueError(f"need num_threads >= 1, max_pending_bytes >= 1 and inline_max_bytes >= 0, got "
                             f"{num_threads}, {max_pending_bytes}, {inline_max_bytes}")
        self.num_threads = num_threads
        self.max_pending_bytes = max_pending_bytes
        self.inline_max_bytes = inline_max_bytes
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenizer")
        # NOTE: the input bytes of the jobs queued or running: added on the loop, taken off by the job's
        # future when it is done (or cancelled while queued), on whichever thread that happens. A call
        # cancelled while its job runs leaves its bytes counted until the job ends: the bound is on the work,
        # not on the callers.
        self._lock = threading.Lock()
        self._pending_bytes = 0

    def runs_inline(self, size: int) -> bool:
        return size <= self.inline_max_bytes

    async def run(self, job: Callable[[], _T], *, size: int) -> _T:
        """`job()`'s result; inline when `size` (the input's, in bytes) is small. Raises what `job` raises,
        and EngineOverloaded when the jobs queued or running hold `max_pending_bytes` already (one job of any
        size is taken when there is none)."""
        if size <= self.inline_max_bytes:
            return job()
        with self._lock:
            if self._pending_bytes and self._pending_bytes + size > self.max_pending_bytes:
                raise EngineOverloaded(f"too many long texts waiting to be tokenized "
                                       f"({self._pending_bytes} bytes); retry later")
            self._pending_bytes += size
        try:
            future: Future[_T] = self._executor.submit(job)
        except BaseException:
            self._done(size)
            raise
        future.add_done_callback(lambda _: self._done(size))
        return await asyncio.wrap_future(future)

    def _done(self, size: int) -> None:
        with self._lock:
            self._pending_bytes -= size

    def shutdown(self) -> None:
        """No new jobs; queued ones are dropped, a running one finishes on its thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)
