#!/usr/bin/env python3
"""Gateway benchmark (not a test): genai-bench drives the smg gateway, which routes to our workers over gRPC.

1) start N `engine-server` workers (vllm.grpc.engine.VllmEngine beside engine.v1 on each port);
2) start `smg launch` on 127.0.0.1 with --worker-urls grpc://... and wait until it lists them healthy;
3) run genai-bench (PyPI, in its own venv: .tools/genai-bench-venv, ~1.3 GB) offline: OpenAI chat completions,
   streaming, scenario D(100,100), each concurrency level for at most --max-requests / --max-minutes;
4) read its per-run JSON and write TTFT, TPOT, throughput and error rate to a dated section of BENCHMARKS.md.
Gateway and workers are always stopped. Everything shares the machine's cores (load average is recorded).

Setup: python -m venv .tools/genai-bench-venv && .tools/genai-bench-venv/bin/pip install genai-bench==0.0.5
Usage: gateway_bench.py [--workers 2] [--concurrency 1,2,4,8,16,32,64] [--max-requests 40] [--max-minutes 1]
                        [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "gateway"))

from engine_server.models.tiny import default_model_dir  # noqa: E402
from serverproc import RunningServer, start_server  # noqa: E402
from smgproc import start_gateway  # noqa: E402

MODEL = "tiny"
SCENARIO = "D(100,100)"
GENAI_BENCH = ROOT / ".tools" / "genai-bench-venv" / "bin" / "genai-bench"
MARK_START = "<!-- gateway_bench:start -->"
MARK_END = "<!-- gateway_bench:end -->"


@dataclass(frozen=True, slots=True)
class Row:
    concurrency: int
    num_requests: int
    num_completed: int
    error_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    output_tok_s: float
    total_tok_s: float
    requests_per_s: float

    @classmethod
    def from_genai_bench(cls, data: dict[str, Any]) -> Row:
        metrics = data["aggregated_metrics"]
        stats = metrics["stats"]
        scale = 1000.0 if data.get("_time_unit", "s") == "s" else 1.0  # TPOT in ms
        to_s = 1.0 if data.get("_time_unit", "s") == "s" else 0.001
        return cls(
            concurrency=int(metrics["num_concurrency"]),
            num_requests=int(metrics["num_requests"]),
            num_completed=int(metrics["num_completed_requests"]),
            error_rate=float(metrics["error_rate"]),
            ttft_p50_s=stats["ttft"]["p50"] * to_s,
            ttft_p99_s=stats["ttft"]["p99"] * to_s,
            tpot_p50_ms=stats["tpot"]["p50"] * scale,
            tpot_p99_ms=stats["tpot"]["p99"] * scale,
            output_tok_s=float(metrics["mean_output_throughput_tokens_per_s"]),
            total_tok_s=float(metrics["mean_total_tokens_throughput_tokens_per_s"]),
            requests_per_s=float(metrics["requests_per_second"]),
        )


def start_workers(count: int, *, max_num_seqs: int, torch_threads: int) -> list[RunningServer]:
    # NOTE: one after the other from the main thread: serverproc sets PR_SET_PDEATHSIG, which fires when the
    # thread that started a server exits (a thread pool would kill the workers as soon as it shut down).
    args = ("--served-model-name", MODEL, "--max-num-seqs", str(max_num_seqs), "--drain-timeout", "1")
    workers: list[RunningServer] = []
    try:
        for _ in range(count):
            # One torch thread per worker: on a shared 2-core machine a 2-thread op barrier waits for a free
            # core on every op (BENCHMARKS.md, Engine section).
            workers.append(start_server(*args, env={"OMP_NUM_THREADS": str(torch_threads)}))
    except BaseException:
        for worker in workers:
            worker.stop(signal.SIGKILL)
        raise
    return workers


def run_genai_bench(base_url: str, *, concurrency: list[int], max_requests: int, max_minutes: int,
                    out_dir: Path) -> list[Row]:
    if not GENAI_BENCH.exists():
        raise SystemExit(f"genai-bench not found at {GENAI_BENCH}; see the setup line in the docstring")
    command = [
        str(GENAI_BENCH), "benchmark", "--api-backend", "openai", "--api-base", base_url,
        "--api-key", "dummy",
        "--task", "text-to-text", "--api-model-name", MODEL, "--model-tokenizer", str(default_model_dir()),
        "--traffic-scenario", SCENARIO, *(a for c in concurrency for a in ("--num-concurrency", str(c))),
        "--max-requests-per-run", str(max_requests), "--max-time-per-run", str(max_minutes),
        "--experiment-base-dir", str(out_dir), "--experiment-folder-name", "run", "--log-dir", str(out_dir),
        # Exactly 100 output tokens per request (the random tiny model would stop at EOS anywhere).
        "--additional-request-params", json.dumps({"ignore_eos": True, "temperature": 0}),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with (out_dir / "genai-bench.out").open("wb") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out_dir)
    runs = (out_dir / "run").glob("D*_*.json")
    rows = [Row.from_genai_bench(json.loads(path.read_text())) for path in runs]
    return sorted(rows, key=lambda row: row.concurrency)


def markdown(
    rows: list[Row], *, num_workers: int, max_requests: int, max_minutes: int, load: str, torch_threads: int
) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        MARK_START,
        f"## Gateway: genai-bench -> smg -> {num_workers} workers ({date})",
        "",
        f"`bench/gateway_bench.py`: genai-bench 0.0.5 (OpenAI chat completions, streaming) -> smg 1.13.0 "
        f"(round_robin) -> {num_workers} x `engine-server` (tiny random-weight Llama, CPU, "
        f"{torch_threads} torch thread each) over "
        f"vllm.grpc.engine.VllmEngine. Scenario {SCENARIO} (100 prompt and 100 output tokens, ignore_eos), "
        f"each concurrency for at most {max_requests} requests or {max_minutes} min. "
        f"{platform.machine()}, {os.cpu_count()} cores shared by the load generator, the gateway and the "
        f"workers; load average before the run: {load}. TTFT and TPOT as genai-bench measures them at the "
        "client (TPOT = (end-to-end - TTFT) / (output tokens - 1)).",
        "",
        "| concurrency | requests (ok/sent) | error rate | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) "
        "| TPOT p99 (ms) | output tok/s | total tok/s | req/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.concurrency} | {r.num_completed}/{r.num_requests} | {r.error_rate:.1%} "
            f"| {r.ttft_p50_s:.2f} | {r.ttft_p99_s:.2f} | {r.tpot_p50_ms:.0f} | {r.tpot_p99_ms:.0f} "
            f"| {r.output_tok_s:.1f} | {r.total_tok_s:.1f} | {r.requests_per_s:.2f} |"
        )
    lines.append(MARK_END)
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace this benchmark's section (between its markers), or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        text = head + section + rest.split(MARK_END, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--max-requests", type=int, default=40)
    parser.add_argument("--max-minutes", type=int, default=1)
    parser.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of each worker")
    parser.add_argument("--markdown", type=Path, default=None, help="BENCHMARKS.md to update")
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    workers = start_workers(args.workers, max_num_seqs=max(concurrency), torch_threads=args.torch_threads)
    try:
        with start_gateway([w.target for w in workers]) as gateway:
            gateway.wait_for_workers(len(workers))
            out_dir = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
            print(f"genai-bench -> {gateway.url} (results in {out_dir})", flush=True)
            rows = run_genai_bench(gateway.url, concurrency=concurrency, max_requests=args.max_requests,
                                   max_minutes=args.max_minutes, out_dir=out_dir)
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                worker.stop(signal.SIGTERM)
    section = markdown(rows, num_workers=args.workers, max_requests=args.max_requests,
                       max_minutes=args.max_minutes, load=load, torch_threads=args.torch_threads)
    print(section)
    if args.markdown is not None:
        write_section(args.markdown, section)


if __name__ == "__main__":
    main()
