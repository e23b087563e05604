#!/usr/bin/env python3
"""Cache-aware scale-out (issue 40; not a test): smg in front of N workers, the same chat workload per policy.

Workload: `--conversations` conversations, each on one of `--system-prompts` long system prompts, grow turn by
turn (`--turns`; each turn's request carries the whole history, with fixed assistant turns so every policy
sends the same request sequence), `--concurrency` conversations at a time, streamed chat completions through
smg's OpenAI endpoint. Policies: `round_robin`; `cache_aware` without events (the workers' SubscribeKvEvents
switched off with ENGINE_SERVER_KV_EVENTS=off: smg's own approximate tree, the state before issue 40);
`cache_aware` with our KV events. Each run starts fresh workers (an empty cache) and a fresh smg; a single
worker with all the traffic is the hit-rate reference. Reported: the prefix-cache hit rate (cached prompt
tokens / prompt tokens, from each response's usage), TTFT p50 / p99 (first content chunk, at the client),
requests and output tokens per second.

Each worker's KV cache holds about half the system prompts (`--kv-blocks`), so placement matters.
Usage: fleet_cache_bench.py [--workers 2,3] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gateway.smgproc import start_gateway  # noqa: E402
from serverproc import RunningServer, start_servers  # noqa: E402

MODEL = "tiny"
MARK_START = "<!-- fleet_cache_bench:start -->"
MARK_END = "<!-- fleet_cache_bench:end -->"
WORDS = ["harbor", "lantern", "meadow", "copper", "willow", "granite", "ember", "falcon", "quartz", "tundra",
         "saffron", "orchid", "basalt", "cobalt", "juniper", "marble"]
POLICIES = ("round_robin", "cache_aware (no events)", "cache_aware (events)")


@dataclass(frozen=True, slots=True)
class Result:
    workers: int
    policy: str
    num_requests: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    requests_per_s: float
    output_tok_s: float


def system_prompt(index: int, num_words: int) -> str:
    return " ".join(f"{WORDS[(index * 5 + i * 3) % len(WORDS)]}{(index * 31 + i) % 89}"
                    for i in range(num_words))


def conversation_requests(index: int, args: argparse.Namespace) -> list[list[dict[str, str]]]:
    """Each turn's messages: the system prompt, the turns so far (fixed assistant replies), the question."""
    messages = [{"role": "system", "content": system_prompt(index % args.system_prompts, args.system_words)}]
    turns = []
    for turn in range(args.turns):
        messages = [*messages, {"role": "user", "content": f"question {turn} of conversation {index}: "
                                                            + " ".join(WORDS[(index + turn + k) % 16]
                                                                       for k in range(10))}]
        turns.append(messages)
        messages = [*messages, {"role": "assistant", "content": " ".join(WORDS[(turn * 7 + k) % 16]
                                                                         for k in range(15))}]
    return turns


async def run_workload(url: str, args: argparse.Namespace) -> tuple[list[float], int, int, int, float]:
    """(TTFTs in s, prompt tokens, cached prompt tokens, output tokens, wall seconds)."""
    ttfts: list[float] = []
    totals = [0, 0, 0]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(args.conversations):
        queue.put_nowait(index)

    async def one(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> None:
        body = {"model": MODEL, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first: float | None = None
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                event = json.loads(line.removeprefix("data:"))
                if first is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    first = time.perf_counter() - start
                usage = event.get("usage")
                if usage:
                    totals[0] += usage["prompt_tokens"]
                    totals[1] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    totals[2] += usage["completion_tokens"]
        ttfts.append(first if first is not None else time.perf_counter() - start)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            index = queue.get_nowait()
            for messages in conversation_requests(index, args):
                await one(client, messages)

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300.0) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return ttfts, totals[0], totals[1], totals[2], time.perf_counter() - started


def run(num_workers: int, policy: str, args: argparse.Namespace) -> Result:
    env = {"OMP_NUM_THREADS": "1"}
    if policy == "cache_aware (no events)":
        env["ENGINE_SERVER_KV_EVENTS"] = "off"
    workers: list[RunningServer] = start_servers(
        num_workers, "--served-model-name", MODEL, "--max-num-seqs", "16", "--num-kv-blocks",
        str(args.kv_blocks), "--log-level", "warning", env=env)
    try:
        smg_policy = "round_robin" if policy == "round_robin" else "cache_aware"
        with start_gateway([w.target for w in workers], policy=smg_policy) as gateway:
            gateway.wait_for_workers(num_workers)
            if policy == "cache_aware (events)":
                time.sleep(2.0)  # smg subscribes to each worker's events
            workload = run_workload(gateway.url, args)
            ttfts, prompt_tokens, cached, output_tokens, seconds = asyncio.run(workload)
    finally:
        for worker in workers:
            worker.stop(signal.SIGTERM)
    ttfts.sort()
    return Result(num_workers, policy, len(ttfts), cached / max(prompt_tokens, 1),
                  statistics.median(ttfts) * 1e3, ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] * 1e3,
                  len(ttfts) / seconds, output_tokens / seconds)


def markdown(results: list[Result], args: argparse.Namespace, command: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    single = next((r for r in results if r.workers == 1), None)
    lines = [
        MARK_START,
        f"## Cache-aware scale-out: smg with our KV events (issue 40) ({now})",
        "",
        f"`{command}` on {platform.node()} ({os.cpu_count()} CPUs shared by smg, the workers and the client; "
        f"load average {os.getloadavg()[0]:.1f} at the end), tiny test model, one torch thread a "
        "worker, "
        f"{args.kv_blocks} KV blocks of 16 a worker. Workload: {args.conversations} conversations on "
        f"{args.system_prompts} system prompts of {args.system_words} words, {args.turns} turns each (the "
        f"whole history every turn), {args.concurrency} at a time, {args.max_tokens} tokens out, streamed "
        "chat "
        "completions through smg; the same request sequence for every policy, fresh workers and gateway each "
        "run.",
        "",
        "| workers | policy | requests | prefix-cache hit rate | vs 1 worker | TTFT p50 | TTFT p99 | req/s "
        "| out tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r.hit_rate / single.hit_rate:.2f}x" if single is not None and single.hit_rate else "-"
        lines.append(f"| {r.workers} | {r.policy} | {r.num_requests} | {r.hit_rate:.3f} | {ratio} | "
                     f"{r.ttft_p50_ms:.0f} ms | {r.ttft_p99_ms:.0f} ms | {r.requests_per_s:.2f} | "
                     f"{r.output_tok_s:.0f} |")
    for n in sorted({r.workers for r in results if r.workers > 1}):
        by_policy = {r.policy: r for r in results if r.workers == n}
        rr, events = by_policy.get("round_robin"), by_policy.get("cache_aware (events)")
        if rr is not None and events is not None:
            lines.append("")
            lines.append(f"{n} workers, cache_aware with events vs round_robin: TTFT p99 "
                         f"{events.ttft_p99_ms / rr.ttft_p99_ms:.2f}x (target <= 0.6x), hit rate "
                         f"{events.hit_rate:.3f} vs {rr.hit_rate:.3f}"
                         + (f" ({events.hit_rate / single.hit_rate:.2f}x the single worker's; target >= 0.9x)"
                            if single is not None and single.hit_rate else "") + ".")
    lines.append(MARK_END)
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2,3")
    p.add_argument("--system-prompts", type=int, default=16)
    p.add_argument("--system-words", type=int, default=150, help="~6.5 tokens a word: ~1,000 tokens")
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=600, help="per worker (~half the system prompts fit)")
    p.add_argument("--markdown", default=None, help="write the section into this file (BENCHMARKS.md)")
    args = p.parse_args()
    results = [run(1, "round_robin", args)]
    print(results[-1], flush=True)
    for num_workers in (int(n) for n in args.workers.split(",")):
        for policy in POLICIES:
            results.append(run(num_workers, policy, args))
            print(results[-1], flush=True)
    command = "bench/fleet_cache_bench.py " + " ".join(sys.argv[1:])
    section = markdown(results, args, command.strip())
    print(section)
    if args.markdown:
        path = Path(args.markdown)
        text = path.read_text() if path.exists() else ""
        if MARK_START in text:
            text = text[:text.index(MARK_START)] + section + text[text.index(MARK_END) + len(MARK_END) + 1:]
        else:
            text = text.rstrip("\n") + "\n\n" + section
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
