"""`--api-workers N`: the one `--metrics-port` endpoint reports the whole server, every frontend process.

The primary serves the endpoint. At each scrape it asks every worker, over the worker's status pipe, for its
registry in the OpenMetrics text format (prometheus_client's exposition; its parser reads it back into the
same families `collect()` yields) and merges them into its own:
- counters and histograms (requests, tokens, latencies, the HTTP/2 guard's counters) are summed, so a
  dashboard or alert reads the same series whatever N is; `_created` takes the earliest;
- gauges come from the primary only: the load gauges read the shared core's stats, which every frontend
  sees alike.
NOTE: sums, not a per-process label: which process the kernel hands a connection to is an accident an
operator cannot act on, and per-process series would multiply every query by N. A worker that does not
answer in time (or has died) counts with its last answer, so no sum ever goes down (Prometheus would read
a drop as a counter reset). The workers are asked at once (`scrape_all`), so a scrape lasts about one
`SCRAPE_TIMEOUT_S` however many of them do not answer.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0  # per scrape, every worker at once; Prometheus' own scrape timeout defaults to 10 s
_SUMMED_TYPES = frozenset({"counter", "histogram", "summary"})

_SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def merge_families(own: Iterable[Metric], workers: Iterable[Iterable[Metric]]) -> list[Metric]:
    """`own` with the workers' counters and histograms added in (see the module docstring)."""
    families: dict[str, Metric] = {}  # the first seen of each name: its type, help and unit
    samples: dict[str, dict[_SampleKey, Sample]] = {}

    def add(family: Metric) -> None:
        known = families.setdefault(family.name, family)
        if known.type != family.type:
            return  # pragma: no cover - one code base on both ends
        into = samples.setdefault(family.name, {})
        for sample in family.samples:
            key = _key(sample)
            seen = into.get(key)
            into[key] = sample if seen is None else seen._replace(value=_combine(sample, seen))

    for family in own:
        add(family)
    for worker in workers:
        for family in worker:
            if family.type in _SUMMED_TYPES:
                add(family)
    merged = []
    for name, family in families.items():
        out = Metric(family.name, family.documentation, family.type, family.unit)
        out.samples = list(samples[name].values())
        merged.append(out)
    return merged


def _key(sample: Sample) -> _SampleKey:
    return sample.name, tuple(sorted(sample.labels.items()))


def _combine(sample: Sample, seen: Sample) -> float:
    if sample.name.endswith("_created"):
        return min(sample.value, seen.value)  # the series exists since the first process created it
    return seen.value + sample.value


class ServerWideCollector(Collector):
    """The served view: this process's registry merged with what `workers()` returns."""

    def __init__(self, registry: CollectorRegistry, workers: Callable[[], list[list[Metric]]]) -> None:
        self._registry = registry
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        yield from merge_families(self._registry.collect(), self._workers())


class WorkerScraper:
    """The primary's end of one worker's status pipe, once the worker serves: asks for its metrics.

    NOTE: called from the exporter's threads (one per scrape): a lock keeps one question on the pipe at a
    time, and a sequence number skips an answer that came too late for the question before.
    """

    def __init__(self, conn: Connection, *, index: int) -> None:
        self._conn = conn
        self._index = index
        self._lock = threading.Lock()
        self._seq = 0
        self._last: list[Metric] = []
        self._is_closed = False

    def scrape(self, *, timeout: float = SCRAPE_TIMEOUT_S) -> list[Metric]:
        deadline = time.monotonic() + timeout
        # NOTE: waiting for an overlapping scrape's question counts against this scrape's timeout too.
        if not self._lock.acquire(timeout=timeout):
            logger.debug("api worker %d: still asked by another scrape; reporting its last", self._index)
            return self._last
        try:
            if self._is_closed:
                return self._last
            self._seq += 1
            try:
                self._conn.send(self._seq)
                text = self._answer(deadline)
                if text is not None:
                    self._last = list(text_string_to_metric_families(text))  # type: ignore[no-untyped-call]
                    return self._last
            except (OSError, EOFError):
                pass  # the worker is gone
            except Exception:  # NOTE: a scrape must not fail for one worker; its last numbers stand in
                logger.warning("api worker %d: unreadable metrics answer", self._index, exc_info=True)
            logger.debug("api worker %d: no metrics answer; reporting its last", self._index)
            return self._last
        finally:
            self._lock.release()

    @property
    def last(self) -> list[Metric]:
        """The worker's latest answer (empty before its first)."""
        return self._last

    def _answer(self, deadline: float) -> str | None:
        while self._conn.poll(max(0.0, deadline - time.monotonic())):
            answer = self._conn.recv()
            if isinstance(answer, tuple) and answer[0] == self._seq:
                return str(answer[1])
        return None

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            self._conn.close()


def scrape_all(scrapers: Sequence[WorkerScraper], *, timeout: float = SCRAPE_TIMEOUT_S) -> list[list[Metric]]:
    """Every worker's families (its last ones where it does not answer), the workers asked at once.

    NOTE: one thread per worker for the length of one scrape: asked one after another, N-1 unresponsive
    workers would hold a scrape for N-1 timeouts, and Prometheus would give up on the whole target.
    """
    if len(scrapers) < 2:
        return [scraper.scrape(timeout=timeout) for scraper in scrapers]
    with ThreadPoolExecutor(max_workers=len(scrapers), thread_name_prefix="api-worker-scrape") as pool:
        return list(pool.map(lambda scraper: scraper.scrape(timeout=timeout), scrapers))


def answer_scrapes(conn: Connection, registry: CollectorRegistry, *, index: int) -> threading.Thread:
    """The worker's end: a daemon thread answers each question with the registry's exposition."""

    def serve() -> None:
        with contextlib.suppress(EOFError, OSError):  # the primary closed the pipe, or we are exiting
            while True:
                seq = conn.recv()
                conn.send((seq, generate_latest(registry).decode()))  # type: ignore[no-untyped-call]

    thread = threading.Thread(target=serve, name=f"api-worker-{index}-metrics", daemon=True)
    thread.start()
    return thread
