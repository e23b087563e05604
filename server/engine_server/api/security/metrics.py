"""Prometheus view of the HTTP/2 guard's counters, read at scrape time (nothing on the hot path)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_server.api.security.budget import GuardStats


class GuardStatsCollector(Collector):
    def __init__(self, stats: GuardStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        goaways = CounterMetricFamily(
            "engine_http2_goaways",
            "HTTP/2 connections closed by the guard, by reason (too_many_pings, rapid_reset, idle, ...)",
            labels=["reason"],
        )
        for reason, count in sorted(self._stats.goaways.items()):
            goaways.add_metric([reason], count)
        yield goaways
        yield CounterMetricFamily(
            "engine_http2_refused_streams",
            "streams refused (REFUSED_STREAM): past SETTINGS_MAX_CONCURRENT_STREAMS, or while cancelled "
            "handlers were still unwinding",
            value=self._stats.num_refused_streams,
        )
        yield CounterMetricFamily(
            "engine_http2_dropped_streams",
            "streams opened and reset by the client within one read: never dispatched",
            value=self._stats.num_dropped_streams,
        )
        yield CounterMetricFamily(
            "engine_grpc_fast_path_calls",
            "calls served by the buffered-call fast path (transport/fast_path.py), not grpclib's handler",
            value=self._stats.num_fast_path_calls,
        )
        yield CounterMetricFamily(
            "engine_grpc_direct_calls",
            "fast-path calls started without a task of their own (their messages pushed from the engine)",
            value=self._stats.num_direct_calls,
        )


def register_guard_metrics(registry: CollectorRegistry, stats: GuardStats) -> None:
    """Expose `server.guard_stats` in `registry` (call once per server)."""
    registry.register(GuardStatsCollector(stats))
