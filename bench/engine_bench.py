#!/usr/bin/env python3
"""Engine benchmark (not a test): 64 concurrent requests, our engine vs transformers baselines.

Scenarios, per model (the tiny test model and the ~30M-parameter random-weight config):
- "burst": every request arrives at t=0, mixed prompt lengths, OUTPUT tokens each;
- "staggered": mixed prompt and output lengths, one arrival every gap (default: our engine's burst
  wall time / requests, so the requests arrive over about the time the engine needs to serve them).
Methods: our LLMEngine (in process), sequential model.generate (a subset, its rate is per-request),
static batching with padded model.generate (burst: one batch; staggered: whatever has arrived
forms the next batch), and transformers' continuous batching (generate_batch, burst only).
Reports generated tokens/s, TTFT and inter-token latency p50/p99, and ratios vs our engine.

Usage: engine_bench.py [--models tiny-llama,bench-llama-30m] [--requests 64] [--output 64] [--threads 1]
                       [--gap-ms MS] [--dtype float32|bfloat16] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

import torch
from engine_server.engine.config import EngineConfig
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, SamplingParams
from engine_server.models.tiny import cached_model_dir


@dataclass(slots=True)
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds after the start


@dataclass(slots=True)
class Result:
    method: str
    num_tokens: int = 0
    wall_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s else 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def record(result: Result, arrival: float, stamps: list[float]) -> None:
    result.num_tokens += len(stamps)
    if stamps:
        result.ttft.append(stamps[0] - arrival)
        result.itl.extend(b - a for a, b in itertools.pairwise(stamps))


def workload(num: int, *, output: int, staggered: bool, gap_s: float, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(num):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(16, 129))]
        max_tokens = rng.randrange(output // 4, output * 2) if staggered else output
        out.append(Request(prompt, max_tokens, i * gap_s if staggered else 0.0))
    return out


class StepStamps:
    """A generate() streamer that timestamps each decoding step (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._skipped_prompt = False

    def put(self, value: Any) -> None:
        if not self._skipped_prompt:
            self._skipped_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_engine(model_dir: Path, requests: list[Request], *, num_blocks: int, dtype: str,
               warm: list[Request]) -> Result:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=num_blocks, dtype=dtype,
                                    max_num_batched_tokens=2048))
    for i, r in enumerate(warm):  # untimed: kernel selection and allocator warm-up, as for every method
        engine.add_request(EngineRequest(f"warm{i}", tuple(r.prompt), SamplingParams(
            temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    result = Result("engine")
    stamps: dict[str, list[float]] = {f"r{i}": [] for i in range(len(requests))}
    pending = list(enumerate(requests))
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][1].arrival <= now:
            i, r = pending.pop(0)
            engine.add_request(EngineRequest(f"r{i}", tuple(r.prompt), SamplingParams(
                temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)))
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][1].arrival - now))
            continue
        for d in engine.step():
            stamps[d.request_id].extend([time.perf_counter()] * len(d.new_token_ids))
    result.wall_s = time.perf_counter() - t0
    for i, r in enumerate(requests):
        record(result, t0 + r.arrival, stamps[f"r{i}"])
    return result


def _generate(model: Any, batch: list[Request]) -> list[float]:
    width = max(len(r.prompt) for r in batch)
    ids = torch.full((len(batch), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(batch):  # left padding
        ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
        mask[row, width - len(r.prompt):] = 1
    streamer = StepStamps()
    max_new = max(r.max_tokens for r in batch)
    model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                   pad_token_id=2, streamer=streamer)
    return streamer.times


def run_sequential(model: Any, requests: list[Request], warm: list[Request]) -> Result:
    _generate(model, warm[:1])
    result = Result("sequential generate")
    t0 = time.perf_counter()
    for r in requests:  # NOTE: all arrive at t0; each waits for the ones before it
        times = _generate(model, [r])
        record(result, t0, times[:r.max_tokens])
    result.wall_s = time.perf_counter() - t0
    return result


def run_static(model: Any, requests: list[Request], warm: list[Request]) -> Result:
    """Padded static batching: everything that has arrived forms the next batch."""
    _generate(model, warm)
    result = Result("padded generate")
    pending = list(requests)
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        batch = [r for r in pending if r.arrival <= now]
        if not batch:
            time.sleep(pending[0].arrival - now)
            continue
        pending = [r for r in pending if r.arrival > now]
        times = _generate(model, batch)
        for r in batch:
            record(result, t0 + r.arrival, times[:r.max_tokens])
    result.wall_s = time.perf_counter() - t0
    return result


def run_transformers_cb(model: Any, requests: list[Request], *, num_blocks: int,
                        warm: list[Request]) -> Result:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    result = Result("transformers CB")
    gen = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=False, max_new_tokens=max(r.max_tokens for r in requests), eos_token_id=-1, pad_token_id=2)
    cb = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=2048, page_size=16)
    model.generate_batch([r.prompt for r in warm], generation_config=gen, continuous_batching_config=cb,
                         warmup=False)
    t0 = time.perf_counter()
    outs = model.generate_batch([r.prompt for r in requests], generation_config=gen,
                                continuous_batching_config=cb, record_timestamps=True, warmup=False)
    result.wall_s = time.perf_counter() - t0
    for out in outs.values():
        record(result, t0, list(out.timestamps or []))
    return result


def bench_model(name: str, args: argparse.Namespace) -> list[tuple[str, list[Result]]]:
    from transformers import AutoModelForCausalLM

    model_dir = cached_model_dir(name)
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    model.eval()
    num_blocks = args.requests * (-(-(128 + 2 * args.output) // 16)) + 16  # everything fits: no preemption
    burst = workload(args.requests, output=args.output, staggered=False, gap_s=0)
    # every method first runs these untimed (other prompts: no prefix-cache hits on the timed ones)
    warm = workload(8, output=8, staggered=False, gap_s=0, seed=1)
    burst_runs: list[Callable[[], Result]] = [
        lambda: run_engine(model_dir, burst, num_blocks=num_blocks, dtype=args.dtype, warm=warm),
        lambda: run_sequential(model, burst[:args.sequential], warm),
        lambda: run_static(model, burst, warm),
        lambda: run_transformers_cb(model, burst, num_blocks=num_blocks, warm=warm),
    ]
    burst_results = _run_all(name, "burst", burst_runs)
    # NOTE: arrivals spread over about the time our engine needed for the burst, so the load stays
    # comparable; with much slower arrivals every method just keeps up and waits for the next request.
    gap_s = args.gap_ms / 1000 if args.gap_ms is not None else burst_results[0].wall_s / args.requests
    staggered = workload(args.requests, output=args.output, staggered=True, gap_s=gap_s)
    staggered_runs: list[Callable[[], Result]] = [
        lambda: run_engine(model_dir, staggered, num_blocks=num_blocks, dtype=args.dtype, warm=warm),
        lambda: run_static(model, staggered, warm),
    ]
    staggered_results = _run_all(name, "staggered", staggered_runs)
    return [(f"{name} / burst", burst_results),
            (f"{name} / staggered (one arrival every {gap_s * 1000:.1f} ms)", staggered_results)]


def _run_all(name: str, scenario: str, runs: list[Callable[[], Result]]) -> list[Result]:
    results = []
    for fn in runs:
        with torch.inference_mode():
            res = fn()
        print(f"  {name} {scenario:9s} {res.method:20s} {res.tok_s:9.1f} tok/s", flush=True)
        results.append(res)
    return results


def table(title: str, results: list[Result]) -> str:
    ours = results[0].tok_s
    lines = [f"**{title}**", "", "| method | tokens | wall s | tok/s | engine x | TTFT p50 ms | TTFT p99 ms "
             "| ITL p50 ms | ITL p99 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = ours / r.tok_s if r.tok_s else float("nan")
        ttft = f"{pct(r.ttft, .5) * 1e3:.0f} | {pct(r.ttft, .99) * 1e3:.0f}"
        itl = f"{pct(r.itl, .5) * 1e3:.1f} | {pct(r.itl, .99) * 1e3:.1f}"
        lines.append(f"| {r.method} | {r.num_tokens} | {r.wall_s:.1f} | {r.tok_s:.0f} | {ratio:.2f} "
                     f"| {ttft} | {itl} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny-llama,bench-llama-30m")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output", type=int, default=64, help="new tokens per request (burst)")
    parser.add_argument("--sequential", type=int, default=8, help="requests timed sequentially")
    parser.add_argument("--gap-ms", type=float, default=None,
                        help="staggered inter-arrival gap (default: our engine's burst wall time / requests)")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for every method alike")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights and activations, for every method alike (bfloat16 uses AMX/AVX512-BF16 "
                             "matmuls where the CPU has them)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sections = []
    for name in args.models.split(","):
        sections.extend(bench_model(name, args))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    header = (f"Machine: {cpu}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
              f"{torch.get_num_threads()} torch thread(s), {args.dtype}, torch {torch.__version__}, "
              f"python {platform.python_version()}. Command: `{' '.join(sys.argv)}`\n\n"
              f"Sequential generate: the first {args.sequential} requests (tok/s is a per-request rate). "
              f"Ratios: our engine's tok/s over the method's.\n")
    text = header + "\n" + "\n".join(table(title, res) for title, res in sections)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
