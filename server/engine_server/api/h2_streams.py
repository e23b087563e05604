"""h2's open-stream count without a scan of every stream per new stream.

h2 counts open streams (to enforce SETTINGS_MAX_CONCURRENT_STREAMS) by walking its whole stream table on
every HEADERS that opens a stream, and drops closed streams from the table on the same walk: at 256
concurrent streams that walk was ~3% of the frontend's CPU. The table's size is an upper bound on the count,
so the walk is only needed when that bound could reach the limit; it also runs once the table has doubled
since the last walk, so closed streams are still dropped and the table stays within twice the open streams.
"""

from __future__ import annotations

from h2.connection import H2Connection

_MIN_SCAN_SIZE = 64


class LazyCountingH2Connection(H2Connection):
    """An H2Connection whose `_open_streams` walks the table only when the answer could matter."""

    _scan_above = 0  # the table size after the last walk, doubled (a class default: set on first use)

    def _open_streams(self, remainder: int) -> int:
        size = len(self.streams)
        is_inbound = remainder == int(not self.config.client_side)
        settings = self.local_settings if is_inbound else self.remote_settings
        limit = settings.max_concurrent_streams
        if size + 1 <= limit and size < self._scan_above:
            # NOTE: every caller compares `count + 1` with a limit; the table size is at least the count.
            return size
        count = super()._open_streams(remainder)
        self._scan_above = max(2 * len(self.streams), _MIN_SCAN_SIZE)
        return count


def use_lazy_counting(connection: H2Connection) -> None:
    """Switch a connection grpclib created (it builds a plain H2Connection) to the lazy count."""
    if type(connection) is H2Connection:
        connection.__class__ = LazyCountingH2Connection
