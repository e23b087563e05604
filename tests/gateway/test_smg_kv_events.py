"""smg's cache-aware routing over our workers' KV events (issue 40): the gateway subscribes to each worker,
applies its batches (no `smg_kv_events_unavailable`, no resync storm) and sends a repeated long prefix to the
worker that holds it: each prefix misses the cache once, on its first request, and hits on every repeat."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from serverproc import RunningServer, start_server, start_servers
from smgproc import RunningGateway, free_port, start_gateway

MODEL = "tiny"
TIMEOUT_S = 120.0
NUM_PREFIXES = 4
NUM_REPEATS = 4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers() -> Iterator[list[RunningServer]]:
    servers = start_servers(2, "--served-model-name", MODEL, "--max-num-seqs", "8", "--drain-timeout", "1",
                            env={"OMP_NUM_THREADS": "1"})
    try:
        yield servers
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def gateway(workers: list[RunningServer]) -> Iterator[RunningGateway]:
    with start_gateway([w.target for w in workers], "--log-level", "info", policy="cache_aware") as gw:
        gw.wait_for_workers(2)
        yield gw


def kv_samples(gateway: RunningGateway, prefix: str) -> dict[str, float]:
    return {name: value for name, value in gateway.metrics().items() if name.startswith(prefix)}


def wait_subscribed(gateway: RunningGateway, workers: list[RunningServer]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        batches = kv_samples(gateway, "smg_kv_event_batches_total")
        if all(any(w.target in name for name in batches) for w in workers):
            return
        time.sleep(0.2)
    raise AssertionError(f"smg never took a batch from each worker:\n{gateway.log()[-3000:]}")


def long_prompt(seed: int) -> str:
    words = ["harbor", "lantern", "meadow", "copper", "willow", "granite", "ember", "falcon", "quartz",
             "tundra"]
    return " ".join(f"{words[(seed * 7 + i * 3) % len(words)]}{(seed * 13 + i) % 97}" for i in range(160))


def cached_tokens(gateway: RunningGateway, prompt: str) -> tuple[int, int]:
    """(prompt tokens, of which served from the prefix cache) of one completion through smg."""
    reply = httpx.post(f"{gateway.url}/v1/completions", timeout=TIMEOUT_S,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_smg_applies_our_kv_events_and_routes_a_prefix_to_its_worker(
        gateway: RunningGateway, workers: list[RunningServer]) -> None:
    wait_subscribed(gateway, workers)
    misses = 0
    for seed in range(NUM_PREFIXES):
        for repeat in range(NUM_REPEATS):
            num_prompt, num_cached = cached_tokens(gateway, long_prompt(seed) + f" question {repeat}")
            assert num_prompt > 400
            if num_cached < num_prompt // 2:
                misses += 1
            time.sleep(0.3)  # the events reach smg within a step or two
    # 1) every prefix missed once (its first request), then went where it is cached
    assert misses == NUM_PREFIXES
    # 2) smg took our batches and blocks, with no unavailable stream and no resync storm
    metrics = gateway.metrics()
    applied = sum(v for k, v in metrics.items()
                  if k.startswith("smg_kv_event_batches_total") and 'disposition="applied"' in k)
    stored = sum(v for k, v in metrics.items() if k.startswith("smg_kv_event_blocks_total") and "stored" in k)
    assert applied > 0
    assert stored >= NUM_PREFIXES * 400 // 16
    assert not any(v for k, v in metrics.items() if k.startswith("smg_kv_events_unavailable"))
    resyncs = {k: v for k, v in metrics.items() if k.startswith("smg_kv_event_resyncs_total") and v}
    # (smg counts the snapshot each subscription starts with as a resync: one per worker, nothing else)
    assert all('reason="snapshot"' in k for k in resyncs), resyncs
    assert sum(resyncs.values()) == len(workers), resyncs
    assert sum(v for k, v in metrics.items() if k.startswith("smg_kv_event_gaps_total")) == 0


def test_smg_resyncs_after_a_worker_restart() -> None:
    """A restarted worker is a new engine instance: smg's cursor is refused (OUT_OF_RANGE), smg clears what it
    knew of the worker and takes a snapshot, and routing sees the new worker's cache."""
    port = free_port()
    args = ("--served-model-name", MODEL, "--max-num-seqs", "8", "--drain-timeout", "1", "--port", str(port))
    env = {"OMP_NUM_THREADS": "1"}
    worker = start_server(*args, env=env)
    try:
        with start_gateway([worker.target], "--log-level", "info", policy="cache_aware") as gateway:
            gateway.wait_for_workers(1)
            wait_subscribed(gateway, [worker])
            cached_tokens(gateway, long_prompt(11))
            worker.stop(signal.SIGKILL)
            worker = start_server(*args, env=env)
            gateway.wait_for_workers(1)
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline:
                resyncs = kv_samples(gateway, "smg_kv_event_resyncs_total")
                if sum(v for k, v in resyncs.items() if 'reason="snapshot"' not in k):
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"smg did not resync after the restart:\n{gateway.log()[-3000:]}")
            assert cached_tokens(gateway, long_prompt(12))[1] == 0
            time.sleep(0.5)
            num_prompt, num_cached = cached_tokens(gateway, long_prompt(12) + " again")
            assert num_cached >= num_prompt // 2
    finally:
        if worker.process.poll() is None:
            worker.stop(signal.SIGKILL)
