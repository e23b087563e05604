#!/usr/bin/env python3
"""Server benchmark (not a test): the same engine served over gRPC vs called in process, side by side.

At each concurrency (default 1, 16, 64, 256) every stream starts at once with the same prompt length and
OUTPUT tokens (greedy, ignore_eos). Reports generated tokens/s and TTFT p50/p99 for:
- "in-process": `AsyncEngine.generate` in this process (its engine core in its own process, as served);
- "gRPC": `engine-server` in a subprocess, driven by the grpclib client over loopback (streaming Generate).
The two run alternately, never at the same time. The client shares the machine's cores with the server.

Usage: server_bench.py [--concurrency 1,16,64,256] [--output 64] [--prompt 32] [--rounds 2] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from engine_proto.engine.v1 import generate_pb2  # noqa: E402
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub  # noqa: E402
from engine_server.engine.config import EngineConfig  # noqa: E402
from engine_server.engine.types import SamplingParams  # noqa: E402
from engine_server.frontend.async_engine import AsyncEngine  # noqa: E402
from engine_server.frontend.outputs import GenerateRequest  # noqa: E402
from engine_server.models.tiny import default_model_dir  # noqa: E402
from grpclib.client import Channel  # noqa: E402
from serverproc import start_server  # noqa: E402

MARK_START = "<!-- server_bench:start -->"
MARK_END = "<!-- server_bench:end -->"


@dataclass(slots=True)
class Run:
    num_tokens: int = 0
    wall_s: float = 0.0
    ttft: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s else 0.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def prompt_ids(i: int, length: int) -> list[int]:
    # Distinct prompts (no prefix-cache hits across streams), ids well inside the tiny vocabulary.
    return [3 + (i * 7 + k * 13) % 900 for k in range(length)]


async def timed(stream_fn: Callable[[int], Awaitable[tuple[int, float]]], concurrency: int) -> Run:
    run = Run()
    started = time.perf_counter()
    results = await asyncio.gather(*(stream_fn(i) for i in range(concurrency)))
    run.wall_s = time.perf_counter() - started
    for num_tokens, ttft in results:
        run.num_tokens += num_tokens
        run.ttft.append(ttft)
    return run


async def in_process(engine: AsyncEngine, *, concurrency: int, prompt: int, output: int, tag: str) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)

    async def one(i: int) -> tuple[int, float]:
        request = GenerateRequest(f"{tag}-{i}", tuple(prompt_ids(i, prompt)), params)
        started = time.perf_counter()
        ttft, num_tokens = 0.0, 0
        async with contextlib.aclosing(engine.generate(request)) as outputs:
            async for out in outputs:
                for chunk in out.chunks:
                    if chunk.token_ids and not num_tokens:
                        ttft = time.perf_counter() - started
                    num_tokens += len(chunk.token_ids)
        return num_tokens, ttft

    return await timed(one, concurrency)


async def served(stub: EngineServiceStub, *, concurrency: int, prompt: int, output: int) -> Run:
    async def one(i: int) -> tuple[int, float]:
        request = generate_pb2.GenerateRequest(stream=True)
        request.token_ids.ids.extend(prompt_ids(i, prompt))
        request.sampling.temperature = 0.0
        request.stopping.max_tokens = output
        request.stopping.ignore_eos = True
        started = time.perf_counter()
        ttft, num_tokens = 0.0, 0
        async with stub.Generate.open(timeout=600.0) as call:
            await call.send_message(request, end=True)
            async for message in call:
                for completion in message.completions:
                    if completion.token_ids and not num_tokens:
                        ttft = time.perf_counter() - started
                    num_tokens += len(completion.token_ids)
        return num_tokens, ttft

    return await timed(one, concurrency)


def markdown(rows: list[tuple[int, Run, Run]], args: argparse.Namespace) -> str:
    day = datetime.date.today().isoformat()
    lines = [
        MARK_START,
        f"## engine-server: served over gRPC vs in process ({day})",
        "",
        f"`bench/server_bench.py`: tiny model, CPU ({os.cpu_count()} cores, {platform.machine()}, Python "
        f"{platform.python_version()}), prompt {args.prompt} tokens, {args.output} output tokens per stream, "
        f"greedy; all streams start at once; best of {args.rounds} rounds. gRPC: `engine-server` subprocess "
        "+ grpclib client (streaming Generate) on loopback; in-process: `AsyncEngine.generate` in the bench "
        f"process. The client shares the cores with the server. Load average at the end: {_loadavg()}.",
        "",
        "| streams | in-process tok/s | gRPC tok/s | gRPC / in-process | TTFT p50 in-proc / gRPC (ms) "
        "| TTFT p99 in-proc / gRPC (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for concurrency, local, remote in rows:
        ratio = remote.tok_s / local.tok_s if local.tok_s else float("nan")
        lines.append(
            f"| {concurrency} | {local.tok_s:,.0f} | {remote.tok_s:,.0f} | {ratio:.2f}x "
            f"| {pct(local.ttft, 0.5) * 1e3:,.0f} / {pct(remote.ttft, 0.5) * 1e3:,.0f} "
            f"| {pct(local.ttft, 0.99) * 1e3:,.0f} / {pct(remote.ttft, 0.99) * 1e3:,.0f} |"
        )
    lines.append(MARK_END)
    return "\n".join(lines) + "\n"


def _loadavg() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def write_section(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        text = head + section + rest.split(MARK_END, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


async def main(args: argparse.Namespace) -> list[tuple[int, Run, Run]]:
    levels = [int(c) for c in args.concurrency.split(",")]
    max_seqs = str(max(levels))
    model = str(default_model_dir())
    config = EngineConfig(model=model, max_num_seqs=max(levels), num_kv_blocks=args.kv_blocks)
    engine = await AsyncEngine.start(config)
    server = await asyncio.to_thread(
        start_server,
        "--model",
        model,
        "--max-num-seqs",
        max_seqs,
        "--num-kv-blocks",
        str(args.kv_blocks),
        "--log-level",
        "warning",
    )
    channel = Channel("127.0.0.1", server.port)
    stub = EngineServiceStub(channel)
    rows = []
    try:
        # Warm both paths (first-step costs, connection setup).
        await in_process(engine, concurrency=4, prompt=args.prompt, output=8, tag="warm")
        await served(stub, concurrency=4, prompt=args.prompt, output=8)
        for concurrency in levels:
            best_local, best_remote = Run(), Run()
            for round_index in range(args.rounds):
                local = await in_process(
                    engine,
                    concurrency=concurrency,
                    prompt=args.prompt,
                    output=args.output,
                    tag=f"c{concurrency}-r{round_index}",
                )
                remote = await served(stub, concurrency=concurrency, prompt=args.prompt, output=args.output)
                best_local = local if local.tok_s > best_local.tok_s else best_local
                best_remote = remote if remote.tok_s > best_remote.tok_s else best_remote
            rows.append((concurrency, best_local, best_remote))
            print(
                f"{concurrency:>4} streams: in-process {best_local.tok_s:8,.0f} tok/s, "
                f"gRPC {best_remote.tok_s:8,.0f} tok/s ({best_remote.tok_s / best_local.tok_s:.2f}x); "
                f"TTFT p50 {pct(best_local.ttft, 0.5) * 1e3:,.0f} / "
                f"{pct(best_remote.ttft, 0.5) * 1e3:,.0f} ms",
                flush=True,
            )
    finally:
        channel.close()
        await asyncio.to_thread(server.stop)
        await engine.shutdown(timeout=10.0)
    return rows


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-blocks", type=int, default=4096)
    parser.add_argument(
        "--markdown", type=Path, help="write/replace the section in this file (BENCHMARKS.md)"
    )
    args = parser.parse_args()
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        rows = runner.run(main(args))
    section = markdown(rows, args)
    print(section)
    if args.markdown is not None:
        write_section(args.markdown, section)


if __name__ == "__main__":
    cli()
