"""Per-connection budgets (token buckets) and the per-server counters of the HTTP/2 guard."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class GuardStats:
    """Counters of one server, for metrics and tests."""

    goaways: dict[str, int] = field(default_factory=dict)  # reason -> connections closed
    num_refused_streams: int = 0  # RST_STREAM(REFUSED_STREAM): past the stream limit, or handlers unwinding
    num_dropped_streams: int = 0  # opened and reset in one batch: never dispatched
    num_fast_path_calls: int = 0  # calls served by api/transport/fast_path.py
    num_direct_calls: int = 0  # of those, calls started without a task of their own

    def count_goaway(self, reason: str) -> None:
        self.goaways[reason] = self.goaways.get(reason, 0) + 1


class TokenBucket:
    __slots__ = ("_burst", "_last", "_rate", "_tokens")

    def __init__(self, *, burst: float, rate_per_s: float, now: float) -> None:
        self._burst = burst
        self._rate = rate_per_s
        self._tokens = burst
        self._last = now

    def take(self, now: float) -> bool:
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def credit(self, num_tokens: float) -> None:
        self._tokens = min(self._burst, self._tokens + num_tokens)
