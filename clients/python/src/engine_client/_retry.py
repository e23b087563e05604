"""The retry policy of one call, shared by both clients (only the sleep and the transport differ)."""

from __future__ import annotations

from .errors import EngineError, UnavailableError
from .options import ConnectionOptions, fits, remaining


class Attempts:
    """One call's deadline and backoff across its attempts: ``timeout()`` before each, then ``backoff()``."""

    __slots__ = ("_deadline", "_delays")

    def __init__(self, options: ConnectionOptions, timeout: float | None) -> None:
        self._deadline = options.deadline(timeout)
        self._delays = options.retry.delays()

    def timeout(self) -> float | None:
        """What is left of the call's deadline, for the next attempt (None: no deadline)."""
        return remaining(self._deadline)

    def backoff(self, error: EngineError, *, is_repeatable: bool = True) -> float | None:
        """Seconds to sleep before the next attempt, or None when ``error`` is final.

        Final: not UNAVAILABLE, the call may not be repeated, the retries are spent, or the sleep would leave
        no time for another attempt before the deadline.
        """
        if not is_repeatable or not isinstance(error, UnavailableError):
            return None
        delay = next(self._delays, None)
        if delay is None or not fits(self._deadline, delay):
            return None
        return delay
