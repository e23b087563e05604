"""Stop strings matched on streamed text, across token boundaries.

Text that could be the start of a stop string is held back until it either completes the stop string
(the completion ends there) or can no longer match (it is released).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    __slots__ = ("_held", "_include", "_stops")

    def __init__(self, stops: Sequence[str], *, include_in_output: bool) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._include = include_in_output
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to release, the stop string that matched or None).

        After a match the released text ends at the stop string (included per the flag) and the
        matcher must not be fed again.
        """
        if not text:
            return "", None
        buffer = self._held + text
        # 1) The earliest-ending match wins: it is the one a token-by-token stream completes first.
        best_end = -1
        best: str | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or end < best_end or (end == best_end and len(stop) > len(best)):
                best, best_end = stop, end
        if best is not None:
            self._held = ""
            cut = best_end if self._include else best_end - len(best)
            return buffer[:cut], best
        # 2) Hold back the longest suffix that is a proper prefix of some stop string. Candidates start
        # where the stop string's first character occurs; the earliest that fits is the longest.
        keep = 0
        size = len(buffer)
        for stop in self._stops:
            first = stop[0]
            start = max(size - len(stop) + 1, 0)
            while start < size - keep:
                start = buffer.find(first, start, size - keep)
                if start < 0:
                    break
                if stop.startswith(buffer[start:]):
                    keep = size - start
                    break
                start += 1
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], None

    def flush(self) -> str:
        """The held-back text, once no more text will come."""
        held, self._held = self._held, ""
        return held
