#!/usr/bin/env python3
"""Structured output's cost (not a test), three measurements, each side by side in one run:

1. steps: the decode step time with every row constrained by a JSON schema vs unconstrained, at 16 / 64 / 256
   sequences, on the tiny and the 30M test models (rounds alternate plain and constrained; best of each);
2. compile: grammar compile time over the test corpus of JSON schemas (tests/engine/structured_corpus.py),
   cold (a schema the compiler has not seen) and cached (the same schema again), p50 / p99;
3. served: engine-server's generated tokens per second for JSON-schema requests vs plain ones at 64 streams.

Usage: structured_output.py [--device cpu|cuda] [--models tiny-llama,bench-llama-30m] [--seqs 16,64,256]
                            [--streams 64] [--skip steps,compile,served] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "engine"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from engine_proto.engine.v1 import generate_pb2  # noqa: E402
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub  # noqa: E402
from engine_server.engine.config import EngineConfig  # noqa: E402
from engine_server.engine.llm_engine import LLMEngine  # noqa: E402
from engine_server.engine.structured.compiler import GrammarCompiler  # noqa: E402
from engine_server.engine.types import (  # noqa: E402
    EngineRequest,
    SamplingParams,
    StructuredOutput,
    StructuredOutputKind,
)
from engine_server.models.tiny import cached_model_dir  # noqa: E402
from frontend_lib.report import write_section  # noqa: E402
from grpclib.client import Channel  # noqa: E402
from serverproc import start_server  # noqa: E402
from structured_corpus import SCHEMAS  # noqa: E402

MARK_START = "<!-- structured_output:start -->"
MARK_END = "<!-- structured_output:end -->"
PROMPT_LEN = 32
# A schema whose every sentence is long (64 strings before it can close), so that every constrained row keeps
# decoding for the whole measurement, as the plain rows do with ignore_eos.
LONG_SCHEMA = json.dumps({
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                             "minItems": 64, "maxItems": 64}},
    "required": ["items"], "additionalProperties": False,
})


def prompt(i: int) -> tuple[int, ...]:
    return tuple(16 + (i * 7919 + k * 131) % 900 for k in range(PROMPT_LEN))


# 1) step times

def decode_steps(engine: LLMEngine, device: str, num_seqs: int, *, constrained: bool, tag: str,
                 num_steps: int) -> float:
    """Median decode step time (ms) of num_seqs requests admitted together, all constrained or none."""
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 2, ignore_eos=True)
    constraint = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, spec=LONG_SCHEMA) if constrained else None
    for i in range(num_seqs):
        engine.add_request(EngineRequest(f"{tag}{i}", prompt(i), params, constraint))
    times: list[float] = []
    while engine.has_unfinished():
        waiting = engine.stats().num_waiting > 0
        decoding = not waiting and all(
            s.num_computed_tokens >= s.num_tokens - 1 for s in engine.scheduler.running)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if decoding:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])  # the first decode steps warm the masks' lexer states


def step_table(models: list[str], seqs: list[int], device: str, rounds: int, num_steps: int
               ) -> list[tuple[str, int, float, float]]:
    rows = []
    for model in models:
        engine = LLMEngine(EngineConfig(model=str(cached_model_dir(model)), device=device,
                                        max_num_seqs=max(seqs), kv_cache_memory_bytes=2**30))
        for n in seqs:
            plain, json_rows = [], []
            for r in range(rounds):
                plain.append(decode_steps(engine, device, n, constrained=False, tag=f"p{n}.{r}.",
                                          num_steps=num_steps))
                json_rows.append(decode_steps(engine, device, n, constrained=True, tag=f"j{n}.{r}.",
                                              num_steps=num_steps))
            rows.append((model, n, min(plain), min(json_rows)))
            print(f"steps {model} {n}: plain {min(plain):.2f} ms, json {min(json_rows):.2f} ms, "
                  f"{min(json_rows) / min(plain):.2f}x", flush=True)
        del engine
    return rows


# 2) compile times

def compile_times(model: str) -> tuple[list[float], list[float]]:
    """(cold, cached) seconds per schema of the corpus: submit until the request could join the batch."""
    info_dir = cached_model_dir(model)
    config = json.loads((info_dir / "config.json").read_text())
    compiler = GrammarCompiler(model_path=str(info_dir), vocab_size=int(config["vocab_size"]),
                               eos_token_ids=(int(config.get("eos_token_id", 1)),), cache_size=4096)
    compiler.tokenizer  # noqa: B018  (built before timing: a server builds it at start-up)
    cold: list[float] = []
    cached: list[float] = []
    for timings in (cold, cached):
        for _, schema in SCHEMAS:
            constraint = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, spec=json.dumps(schema))
            start = time.perf_counter()
            job = compiler.submit(constraint)
            while (outcome := job.poll(time.monotonic())) is None:
                job.wait(0.001)
            timings.append(time.perf_counter() - start)
            assert not isinstance(outcome, Exception), outcome
    compiler.close()
    return cold, cached


# 3) served throughput

async def served(streams: int, output: int) -> tuple[float, float]:
    """(plain, json) generated tokens per second of `streams` concurrent streamed requests, best of two."""
    server = await asyncio.to_thread(start_server, "--max-num-seqs", str(streams), "--log-level", "warning")
    try:
        channel = Channel("127.0.0.1", server.port)
        stub = EngineServiceStub(channel)

        async def one(i: int, constrained: bool) -> int:
            ids = generate_pb2.TokenIds(ids=prompt(i))
            request = generate_pb2.GenerateRequest(token_ids=ids, stream=True)
            request.sampling.temperature = 0.0
            request.stopping.max_tokens = output
            request.stopping.ignore_eos = True
            if constrained:
                request.structured_output.json_schema = LONG_SCHEMA
            count = 0
            async with stub.Generate.open(timeout=300) as stream:
                await stream.send_message(request, end=True)
                async for response in stream:
                    count += sum(len(c.token_ids) for c in response.completions)
            return count

        async def wave(constrained: bool) -> float:
            start = time.perf_counter()
            counts = await asyncio.gather(*(one(i, constrained) for i in range(streams)))
            return sum(counts) / (time.perf_counter() - start)

        await wave(False)
        await wave(True)  # warm-up: the grammar compiles once and stays cached
        best = {False: 0.0, True: 0.0}
        for _ in range(2):
            for constrained in (False, True):
                best[constrained] = max(best[constrained], await wave(constrained))
        channel.close()
        return best[False], best[True]
    finally:
        server.stop()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def markdown(args: argparse.Namespace, steps: list[tuple[str, int, float, float]],
             compiles: dict[str, tuple[list[float], list[float]]], tok_s: tuple[float, float] | None) -> str:
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as info:
        names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    machine = f"{names[0] if names else cpu}, {os.cpu_count()} CPUs" if args.device == "cpu" else (
        torch.cuda.get_device_name())
    lines = [
        f"### {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {machine}, device {args.device}",
        "",
        f"`python bench/structured_output.py {' '.join(sys.argv[1:])}`, torch {torch.__version__}, "
        f"{args.threads} torch thread(s)",
        "",
    ]
    if steps:
        lines += [
            "Decode step time, every row constrained by a JSON schema (64 strings of at most 12 characters) "
            f"vs unconstrained, greedy, {PROMPT_LEN}-token prompts; best of {args.rounds} alternating "
            "rounds, each the median of its decode steps. Target: <= 1.10x.",
            "",
            "| model | sequences | plain ms | JSON schema ms | ratio |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [f"| {m} | {n} | {p:.2f} | {j:.2f} | {j / p:.2f}x |" for m, n, p, j in steps]
        lines.append("")
    for model, (cold, cached) in compiles.items():
        lines += [
            f"Compile time over the {len(cold)} JSON schemas of tests/engine/structured_corpus.py ({model}'s "
            "tokenizer; submit until the request could join the batch, first mask included):",
            "",
            "| | p50 ms | p99 ms | max ms |",
            "|---|---:|---:|---:|",
            f"| cold | {pct(cold, 0.5) * 1e3:.2f} | {pct(cold, 0.99) * 1e3:.2f} | {max(cold) * 1e3:.2f} |",
            f"| cached | {pct(cached, 0.5) * 1e3:.3f} | {pct(cached, 0.99) * 1e3:.3f} | "
            f"{max(cached) * 1e3:.3f} |",
            "",
        ]
    if tok_s is not None:
        plain, constrained = tok_s
        lines += [
            f"Served (engine-server, tiny model, {args.streams} streams of {args.output} tokens, greedy): "
            f"plain {plain:.0f} tokens/s, JSON schema {constrained:.0f} tokens/s: "
            f"{constrained / plain:.2f}x (target >= 0.9x).",
            "",
        ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", default="tiny-llama,bench-llama-30m")
    p.add_argument("--seqs", default="16,64,256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=24, help="decode steps per round")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--output", type=int, default=64, help="tokens per served request")
    p.add_argument("--skip", default="", help="comma-separated: steps, compile, served")
    p.add_argument("--markdown", type=Path, default=None, help="write the section into this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    models = args.models.split(",")
    steps = [] if "steps" in skip else step_table(models, [int(n) for n in args.seqs.split(",")],
                                                  args.device, args.rounds, args.steps)
    compiles = {} if "compile" in skip else {models[0]: compile_times(models[0])}
    tok_s = None if "served" in skip else asyncio.run(served(args.streams, args.output))
    section = markdown(args, steps, compiles, tok_s)
    print(section)
    if args.markdown is not None:
        write_section(args.markdown, section, start=MARK_START, end=MARK_END, heading="## Structured output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
