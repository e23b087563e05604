"""--api-workers metrics: workers' families merged into the primary's (api/worker_metrics.py)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from multiprocessing.connection import Connection

from engine_server.api.worker_metrics import WorkerScraper, answer_scrapes, merge_families, scrape_all
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.registry import Collector

TIMEOUT_S = 10.0


def _registry(
    *, ok: int, failed: int = 0, latencies: tuple[float, ...] = (), load: float = 0.0, goaways: int = 0
) -> CollectorRegistry:
    """A frontend's registry, shaped like api/metrics.py's (and the guard's collector)."""
    registry = CollectorRegistry()
    requests = Counter("engine_requests", "calls", ["rpc", "code"], registry=registry)
    if ok:
        requests.labels("Generate", "OK").inc(ok)
    if failed:
        requests.labels("Generate", "INVALID_ARGUMENT").inc(failed)
    latency = Histogram("engine_ttft_seconds", "ttft", buckets=(0.1, 1.0), registry=registry)
    for seconds in latencies:
        latency.observe(seconds)
    Gauge("engine_num_running_requests", "running", registry=registry).set(load)

    class Guard(Collector):
        def collect(self) -> list[Metric]:
            family = CounterMetricFamily("engine_http2_goaways", "goaways", labels=["reason"])
            if goaways:
                family.add_metric(["rapid_reset"], goaways)
            return [family]

    registry.register(Guard())
    return registry


def _values(families: list[Metric]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples
            if not s.name.endswith("_created")}


OK = ("engine_requests_total", (("code", "OK"), ("rpc", "Generate")))
SLOW_TIMEOUT_S = 1.0  # long beside the thread start-up, so one timeout and two are far apart


def _exposition(num_ok: int) -> str:
    return str(generate_latest(_registry(ok=num_ok)).decode())  # type: ignore[no-untyped-call]


def _scraped(registry: CollectorRegistry) -> list[Metric]:
    """`registry` as the primary sees it: over a pipe, through the exposition format and its parser."""
    primary_end, worker_end = multiprocessing.Pipe(duplex=True)
    answer_scrapes(worker_end, registry, index=1)
    scraper = WorkerScraper(primary_end, index=1)
    try:
        return scraper.scrape(timeout=TIMEOUT_S)
    finally:
        scraper.close()
        worker_end.close()


def test_counters_and_histograms_are_summed_and_gauges_come_from_the_primary() -> None:
    primary = _registry(ok=2, latencies=(0.05,), load=3.0)
    workers = [
        _registry(ok=5, failed=1, latencies=(0.5, 2.0), load=3.0, goaways=2),
        _registry(ok=1, load=3.0, goaways=1),
    ]
    merged = _values(merge_families(primary.collect(), [_scraped(w) for w in workers]))
    assert merged[("engine_requests_total", (("code", "OK"), ("rpc", "Generate")))] == 8
    # a series only a worker has is reported too
    assert merged[("engine_requests_total", (("code", "INVALID_ARGUMENT"), ("rpc", "Generate")))] == 1
    assert merged[("engine_ttft_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged[("engine_ttft_seconds_bucket", (("le", "1.0"),))] == 2
    assert merged[("engine_ttft_seconds_count", ())] == 3
    assert merged[("engine_ttft_seconds_sum", ())] == 2.55
    assert merged[("engine_http2_goaways_total", (("reason", "rapid_reset"),))] == 3
    assert merged[("engine_num_running_requests", ())] == 3.0  # the shared core's load, once


def test_created_is_the_earliest() -> None:
    primary = _registry(ok=1)
    worker = _registry(ok=1)
    created = [s.value for r in (primary, worker) for f in r.collect() for s in f.samples
               if s.name == "engine_requests_created"]
    merged = merge_families(primary.collect(), [list(worker.collect())])
    merged_created = [s.value for f in merged for s in f.samples if s.name == "engine_requests_created"]
    assert merged_created == [min(created)]


def test_a_worker_that_does_not_answer_in_time_counts_with_its_last_answer() -> None:
    primary_end, worker_end = multiprocessing.Pipe(duplex=True)
    scraper = WorkerScraper(primary_end, index=1)
    try:
        # NOTE: answers queued ahead of the questions: scrape n asks with sequence number n.
        worker_end.send((1, _exposition(4)))
        assert _values(scraper.scrape(timeout=TIMEOUT_S))[OK] == 4
        assert _values(scraper.scrape(timeout=0.05))[OK] == 4  # no answer: the last one stands in
        worker_end.send((2, _exposition(6)))  # too late for scrape 2: skipped by scrape 3
        worker_end.send((3, _exposition(9)))
        assert _values(scraper.scrape(timeout=TIMEOUT_S))[OK] == 9
        worker_end.close()  # the worker is gone: its answers, not its numbers
        assert _values(scraper.scrape(timeout=TIMEOUT_S))[OK] == 9
    finally:
        scraper.close()
    assert _values(scraper.scrape())[OK] == 9  # after the pool stopped


def test_workers_are_asked_at_once_so_slow_ones_cost_one_timeout() -> None:
    answering_end, answering_worker = multiprocessing.Pipe(duplex=True)
    answer_scrapes(answering_worker, _registry(ok=1), index=1)
    silent: list[tuple[Connection, Connection]] = [multiprocessing.Pipe(duplex=True) for _ in range(2)]
    scrapers = [WorkerScraper(answering_end, index=1)]
    scrapers += [WorkerScraper(primary_end, index=i) for i, (primary_end, _) in enumerate(silent, start=2)]
    try:
        # 1) every worker answers the first scrape (the silent ones' answers queued ahead of the question)
        for num_ok, (_, worker_end) in zip((4, 5), silent, strict=True):
            worker_end.send((1, _exposition(num_ok)))
        assert [_values(f)[OK] for f in scrape_all(scrapers, timeout=TIMEOUT_S)] == [1, 4, 5]
        # 2) two of them stop answering: the scrape waits one timeout for both, and they count with their last
        started = time.monotonic()
        families = scrape_all(scrapers, timeout=SLOW_TIMEOUT_S)
        elapsed = time.monotonic() - started
        assert [_values(f)[OK] for f in families] == [1, 4, 5]
        assert 0.9 * SLOW_TIMEOUT_S <= elapsed < 1.75 * SLOW_TIMEOUT_S  # one after another: 2 timeouts
    finally:
        for scraper in scrapers:
            scraper.close()
        for _, worker_end in silent:
            worker_end.close()
        answering_worker.close()


def test_an_overlapping_scrape_waits_within_its_own_timeout() -> None:
    primary_end, worker_end = multiprocessing.Pipe(duplex=True)
    scraper = WorkerScraper(primary_end, index=1)
    earlier_result: list[list[Metric]] = []
    try:
        worker_end.send((1, _exposition(3)))
        assert _values(scraper.scrape(timeout=TIMEOUT_S))[OK] == 3
        assert worker_end.recv() == 1  # that scrape's question
        earlier = threading.Thread(target=lambda: earlier_result.append(scraper.scrape(timeout=TIMEOUT_S)))
        earlier.start()
        assert worker_end.recv() == 2  # the earlier scrape asked, and holds the pipe until it is answered
        started = time.monotonic()
        assert _values(scraper.scrape(timeout=SLOW_TIMEOUT_S))[OK] == 3  # the last answer stands in
        assert time.monotonic() - started < 1.75 * SLOW_TIMEOUT_S  # not the earlier scrape's wait
        worker_end.send((2, _exposition(7)))
        earlier.join(TIMEOUT_S)
        assert _values(earlier_result[0])[OK] == 7
    finally:
        scraper.close()
        worker_end.close()
