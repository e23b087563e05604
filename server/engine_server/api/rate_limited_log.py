"""RateLimitedLog: log lines a client can cause at will, at most one per kind per interval, the rest counted.

A client decides how often some lines are logged: one per connection closed for abuse, one per call rejected
for its API key, one per call it cancels. A flood of those (1,212 GOAWAY warnings in one hardening campaign)
buried everything else in the log. Here the first line of a kind is logged as it comes; the same kind's
lines over the next `interval_s` are only counted, and when the interval ends one line says how many
("... and 1211 more in the last 10 s: <kind>"). A steady flood then logs one line per interval; a kind
quiet for a whole interval logs its next line at once again.

One instance per server (GuardedServer.log_limit), shared by its connections; it lives on the server's event
loop. The count of an interval is logged by a timer on that loop, or, without a running loop, with the
kind's next line; `flush()` logs every pending count (the server calls it when it closes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Interval:
    """A kind's current interval: its first line was logged, the others are counted."""

    logger: logging.Logger
    level: int
    started: float
    until: float
    num_suppressed: int = 0
    timer: asyncio.TimerHandle | None = None


class RateLimitedLog:
    """At most one line per kind per `interval_s`, then "... and K more in the last N s: <kind>"."""

    def __init__(self, *, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self.interval_s = interval_s
        self._clock = clock
        self._intervals: dict[str, _Interval] = {}

    def log(self, logger: logging.Logger, level: int, kind: str, msg: str, *args: object) -> None:
        """`logger.log(level, msg, *args)`, unless a line of `kind` was logged less than `interval_s` ago:
        then only counted. `kind` names the lines in the count's line ("HTTP/2 connections closed: ...")."""
        if not logger.isEnabledFor(level):
            return
        now = self._clock()
        interval = self._intervals.get(kind)
        while interval is not None and now >= interval.until:
            self._end(kind)  # (no running loop: no timer ended it)
            interval = self._intervals.get(kind)
        if interval is None:
            logger.log(level, msg, *args)
            self._intervals[kind] = _Interval(logger, level, started=now, until=now + self.interval_s)
            return
        interval.num_suppressed += 1
        if interval.timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            interval.timer = loop.call_later(max(0.0, interval.until - now), self._end_by_timer, kind)

    def flush(self) -> None:
        """Log every kind's pending count now and forget every interval."""
        now = self._clock()
        for kind in list(self._intervals):
            self._end(kind, now=now)

    def _end_by_timer(self, kind: str) -> None:
        interval = self._intervals.get(kind)
        if interval is not None:
            interval.timer = None
            self._end(kind)

    def _end(self, kind: str, *, now: float | None = None) -> None:
        """The interval of `kind` is over (at its end, or `now`: then nothing follows): its count logged, if
        any. After a count a new interval starts at once (its lines are counted too: a steady flood logs one
        line per interval); after none, the kind's next line is logged as it comes."""
        interval = self._intervals.pop(kind)
        if interval.timer is not None:
            interval.timer.cancel()
            interval.timer = None
        if not interval.num_suppressed:
            return
        end = interval.until if now is None else min(now, interval.until)
        interval.logger.log(interval.level, "... and %d more in the last %.1f s: %s",
                            interval.num_suppressed, end - interval.started, kind)
        if now is None:
            self._intervals[kind] = _Interval(interval.logger, interval.level, started=interval.until,
                                              until=interval.until + self.interval_s)
