"""api/rate_limited_log.py: one line per kind per interval, the rest counted in one line at its end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from engine_server.api.rate_limited_log import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.changed.set()

    @property
    def lines(self) -> list[str]:
        return [record.getMessage() for record in self.records]


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    logger = logging.getLogger("test_rate_limited_log")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


LOG = logging.getLogger("test_rate_limited_log")


def test_one_line_per_interval_then_a_count_with_the_next_line(lines: Lines) -> None:
    clock = Clock()
    limit = RateLimitedLog(interval_s=10.0, clock=clock)
    for peer in range(5):
        limit.log(LOG, logging.WARNING, "bad connections", "closing connection from %s", peer)
        clock.now += 1.0
    assert lines.lines == ["closing connection from 0"]
    # No running loop, so no timer: the count is logged when the kind logs again after its interval ...
    clock.now = 112.0
    limit.log(LOG, logging.WARNING, "bad connections", "closing connection from %s", 5)
    assert lines.lines[1] == "... and 4 more in the last 10.0 s: bad connections"
    assert lines.records[1].levelno == logging.WARNING
    # ... which starts a new interval: the flood goes on, so this line is counted in it
    assert len(lines.lines) == 2
    limit.flush()
    assert lines.lines[2] == "... and 1 more in the last 2.0 s: bad connections"
    # After a quiet interval (or a flush), the next line is logged as it comes.
    clock.now = 200.0
    limit.log(LOG, logging.WARNING, "bad connections", "closing connection from %s", 6)
    assert lines.lines[3] == "closing connection from 6"


def test_a_line_after_a_whole_quiet_interval_is_logged_at_once(lines: Lines) -> None:
    clock = Clock()
    limit = RateLimitedLog(interval_s=10.0, clock=clock)
    limit.log(LOG, logging.INFO, "k", "first")
    limit.log(LOG, logging.INFO, "k", "second")  # counted
    clock.now += 25.0  # the counted interval ended at +10, the next one (nothing in it) at +20
    limit.log(LOG, logging.INFO, "k", "third")
    assert lines.lines == ["first", "... and 1 more in the last 10.0 s: k", "third"]


def test_kinds_are_limited_apart_and_a_disabled_level_is_not_counted(lines: Lines) -> None:
    clock = Clock()
    limit = RateLimitedLog(interval_s=10.0, clock=clock)
    for _ in range(3):
        limit.log(LOG, logging.INFO, "a", "line a")
        limit.log(LOG, logging.INFO, "b", "line b")
        limit.log(LOG, logging.DEBUG, "c", "line c")  # below the logger's level: nothing, not even a count
    limit.flush()
    assert lines.lines == ["line a", "line b", "... and 2 more in the last 0.0 s: a",
                           "... and 2 more in the last 0.0 s: b"]


async def test_the_count_is_logged_by_a_timer_at_the_end_of_the_interval(lines: Lines) -> None:
    limit = RateLimitedLog(interval_s=0.05)
    for peer in range(10):
        limit.log(LOG, logging.WARNING, "bad connections", "closing connection from %s", peer)
    assert lines.lines == ["closing connection from 0"]
    lines.changed.clear()
    async with asyncio.timeout(5.0):  # nothing else logs: the loop's timer does, once the interval is over
        await lines.changed.wait()
    assert lines.lines[1].startswith("... and 9 more in the last ")
    assert lines.lines[1].endswith(" s: bad connections")
    limit.flush()
    assert len(lines.lines) == 2  # (nothing was left to count)


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        RateLimitedLog(interval_s=0.0)
