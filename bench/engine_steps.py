#!/usr/bin/env python3
"""Engine step times (not a test): N requests of a 100-token prompt each admitted at once, then the time of
every prefill and decode step, on any device; optionally a torch profile of a few decode steps at the
largest N.

What the frontend benchmark cannot show: how much of a served step is the engine, and where its time goes
(on a GPU, kernel time vs the CPU time of launching them).

Usage: engine_steps.py [--model DIR] [--device cpu|cuda] [--seqs 1,16,64,256] [--output 32] [--profile]
                       [--cudnn-sdpa]
       (default model: the tiny test model)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

import torch
from engine_server.engine.config import EngineConfig
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, SamplingParams
from engine_server.models.tiny import default_model_dir

PROMPT_LEN = 100


def prompt(i: int) -> tuple[int, ...]:
    return tuple(16 + (i * 7919 + k * 131) % 1000 for k in range(PROMPT_LEN))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_steps(engine: LLMEngine, device: str, num_seqs: int, output: int, tag: str) -> tuple[list[float],
                                                                                                list[float]]:
    """(prefill step times, decode step times) in ms for num_seqs requests admitted together."""
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(EngineRequest(f"{tag}{i}", prompt(len(tag) * 1000 + i), params))
    prefill: list[float] = []
    decode: list[float] = []
    while engine.has_unfinished():
        prefilling = bool(engine.scheduler.waiting) or any(
            s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running)
        _sync(device)
        start = time.perf_counter()
        engine.step()
        _sync(device)
        (prefill if prefilling else decode).append((time.perf_counter() - start) * 1e3)
    return prefill, decode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seqs", default="1,16,64,256")
    p.add_argument("--output", type=int, default=32, help="generated tokens per request")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--kv-cache-memory", type=int, default=4 * 2**30, help="bytes")
    p.add_argument("--profile", action="store_true",
                   help="torch profiles of a prefill step and 5 decode steps at the largest N")
    p.add_argument("--cudnn-sdpa", action="store_true",
                   help="let SDPA use cuDNN, which the engine switches off on CUDA (for comparison)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    seqs = [int(n) for n in args.seqs.split(",")]
    model = args.model or str(default_model_dir())
    engine = LLMEngine(EngineConfig(model=model, device=args.device, max_num_seqs=max(seqs),
                                    kv_cache_memory_bytes=args.kv_cache_memory))
    if args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(True)
    timed_steps(engine, args.device, 4, 4, "warm")
    print(f"model {model} on {args.device}; prompts {PROMPT_LEN} tokens, {args.output} generated each; "
          f"decode attention: {decode_path(engine)}")
    print("| sequences | prefill steps | prefill ms (mean) | decode steps | decode ms p50 | decode ms min | "
          "decode us / token |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in seqs:
        prefill, decode = timed_steps(engine, args.device, n, args.output, f"n{n}-")
        p50 = statistics.median(decode) if decode else float("nan")
        print(f"| {n} | {len(prefill)} | {statistics.fmean(prefill):.1f} | {len(decode)} | {p50:.2f} | "
              f"{min(decode, default=float('nan')):.2f} | {p50 * 1e3 / n:.1f} |", flush=True)
    if args.profile:
        profile_decode(engine, args.device, max(seqs))
    return 0


def decode_path(engine: LLMEngine) -> str:
    runner = engine.runner
    kernel = runner.decode_kernel if runner is not None else None
    graphs = runner is not None and runner.decode_graphs is not None and runner.decode_graphs.is_captured
    name = ("torch (gathered groups + SDPA)" if kernel is None
            else f"{getattr(kernel, '__module__', None) or 'compiled'} kernel")
    return f"{name}, CUDA graphs: {'yes' if graphs else 'no'}"


def profile_decode(engine: LLMEngine, device: str, num_seqs: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    for i in range(num_seqs):
        engine.add_request(EngineRequest(f"prof{i}", prompt(50_000 + i), params))
    engine.step()  # one prefill step untimed, the next one profiled (at 256 sequences both are prefills)
    with profile(activities=activities) as prof:
        engine.step()
        _sync(device)
    print("== one prefill step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    with profile(activities=activities) as prof:
        for _ in range(5):
            engine.step()
        _sync(device)
    print("== five decode steps")
    print(prof.key_averages().table(sort_by=sort, row_limit=25))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    engine.abort(f"prof{i}" for i in range(num_seqs))


if __name__ == "__main__":
    raise SystemExit(main())
