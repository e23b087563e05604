"""The benchmark's workload and its statistics, shared by the load generator and the in-process runner.

A closed loop: `concurrency` workers each send a request, read its stream to the end, and send the next,
until `num_requests` are done. Every request: a distinct 100-token prompt (no prefix-cache hits, also across
the runs of one server: requests are numbered on from the previous run's, see `prompt_ids`), greedy,
ignore_eos, exactly `output` generated tokens. Each worker records when each message arrived and how many
tokens it held.
"""

from __future__ import annotations

import asyncio
import math
import resource
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any


def prompt_ids(i: int, length: int) -> list[int]:
    """Ordinary token ids of the tiny vocabulary (1024 ids, specials below 16), different for every request
    number `i` below 10**9: its first three ids spell `i` in base 1000, so no two requests share a first KV
    block (no prefix-cache hits). (The rest alone repeats every 1000 requests.)"""
    head = [16 + (i // 1_000_000) % 1000, 16 + (i // 1000) % 1000, 16 + i % 1000]
    return (head + [16 + (i * 7919 + k * 131) % 1000 for k in range(3, length)])[:length]


_WORDS = ("the", "engine", "schedules", "every", "request", "in", "one", "batch", "and", "streams", "its",
          "tokens", "back", "to", "a", "client", "that", "waits", "for", "them")


def prompt_text(i: int, length: int) -> str:
    """A text prompt of about `length` tokens of the tiny tokenizer (3 x `length` characters of common words),
    different for every request number `i`: it starts with `i` in digits."""
    words = [str(i)]
    size = len(words[0])
    k = 0
    while size < 3 * length:
        words.append(_WORDS[(i * 7 + k * 13) % len(_WORDS)])
        size += len(words[-1]) + 1
        k += 1
    return " ".join(words)[:3 * length]


@dataclass(slots=True)
class RequestTrace:
    """One request: its send time, and (arrival time, tokens) per streamed message."""

    sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)


# One request: (request index, trace to fill) -> awaitable that completes when its stream ended.
SendFn = Callable[[int, RequestTrace], Awaitable[None]]


async def closed_loop(
    send: SendFn, *, concurrency: int, num_requests: int, first: int = 0
) -> tuple[list[RequestTrace], float]:
    """Runs the workload (requests numbered from `first`); returns the traces and the wall time (first send to
    last message)."""
    traces: list[RequestTrace] = []
    counter = iter(range(first, first + num_requests))

    async def worker() -> None:
        for i in counter:
            trace = RequestTrace(time.perf_counter())
            traces.append(trace)
            await send(i, trace)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return traces, time.perf_counter() - started


def cpu_seconds_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True, slots=True)
class Summary:
    num_requests: int
    num_tokens: int
    num_messages: int
    wall_s: float
    tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_std_ms: float
    itl_mean_ms: float  # per request: (last - first message) / (tokens - 1), averaged
    itl_p99_ms: float  # p99 over requests of that per-request inter-token latency
    client_cpu_pct: float  # the load generator's CPU over the run (100 = one full core)
    # The first wave (every stream's first request, all sent at once) against the requests after it: at high
    # concurrency the first wave is one burst of prefills (hundreds of ms of engine work on the tiny model at
    # 256 streams) that sets the run's p99; the requests after it show steady serving.
    ttft_first_wave_max_ms: float
    ttft_after_first_wave_p99_ms: float  # NaN where the run had only one wave
    ttft_after_first_wave_std_ms: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stddev(values: list[float]) -> float:
    return statistics.pstdev(values) if len(values) > 1 else (0.0 if values else math.nan)


def summarize(traces: list[RequestTrace], *, wall_s: float, client_cpu_s: float, concurrency: int) -> Summary:
    """`traces` in send order (as `closed_loop` returns them): the first `concurrency` are the first wave."""
    ttfts, itls = [], []
    first_wave: list[float] = []
    after_first_wave: list[float] = []
    num_tokens = num_messages = 0
    for index, trace in enumerate(traces):
        arrivals = [a for a in trace.arrivals if a[1] > 0]
        if not arrivals:
            continue
        ttft = (arrivals[0][0] - trace.sent) * 1e3
        ttfts.append(ttft)
        (first_wave if index < concurrency else after_first_wave).append(ttft)
        tokens = sum(n for _, n in arrivals)
        num_tokens += tokens
        num_messages += len(arrivals)
        if tokens > 1:
            itls.append((arrivals[-1][0] - arrivals[0][0]) * 1e3 / (tokens - 1))
    return Summary(
        num_requests=len(traces), num_tokens=num_tokens, num_messages=num_messages, wall_s=wall_s,
        tokens_per_s=num_tokens / wall_s, requests_per_s=len(traces) / wall_s,
        ttft_p50_ms=percentile(ttfts, 0.5), ttft_p90_ms=percentile(ttfts, 0.9),
        ttft_p99_ms=percentile(ttfts, 0.99),
        ttft_std_ms=_stddev(ttfts),
        itl_mean_ms=statistics.fmean(itls) if itls else math.nan, itl_p99_ms=percentile(itls, 0.99),
        client_cpu_pct=100.0 * client_cpu_s / wall_s,
        ttft_first_wave_max_ms=max(first_wave, default=math.nan),
        ttft_after_first_wave_p99_ms=percentile(after_first_wave, 0.99),
        ttft_after_first_wave_std_ms=_stddev(after_first_wave),
    )
