#!/usr/bin/env python3
"""Frontend throughput benchmark (not a test): the same engine behind (a) engine-server (gRPC, as shipped),
(b) an HTTP/SSE reference server (bench/sse_server.py: uvicorn + starlette, JSON chunks) and (c) the engine
called in process, side by side in one run, on the simulated core (fixed step time; measures the frontend
alone) and the real engine on the tiny model. The simulated core runs at 1 ms per step ("sim": 256 streams
then need ~250,000 tokens/s of frontend, so frontends are the bottleneck) and at 5 ms ("sim5": the closed loop
is latency-bound, its ceiling set by the step time; it shows TTFT under a slower engine).

The server side (frontend process(es) + engine core process) is pinned to core 0, the load generator (its own
process, bench/frontend_lib/loadgen.py) to core 1. Server CPU is read from /proc/PID/stat of the whole server
process tree. The in-process baseline has no load generator: its client work is inside its CPU figure.

Usage: bench/frontend.py [--quick] [--engines sim,sim5,tiny] [--servers grpc,grpc2,sse,inproc] [--step-ms 1]
                         [--concurrency 1,16,64,256] [--rounds 2] [--markdown BENCHMARKS.md]
       A model of your own (on a GPU, say): --engines model --model DIR --device cuda --server-cores 0,1
       --client-core 2 --section gpu (the engine core then has a core of its own, as in vLLM's setup).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from engine_server.proc_title import ENGINE_CORE  # noqa: E402
from frontend_lib import report  # noqa: E402
from frontend_lib.procstat import cpu_seconds, descendants, process_name  # noqa: E402

READY_TIMEOUT_S = 300.0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"  # the server side has one core: one torch thread
    return env


def _pinned(cores: set[int]) -> Any:
    def preexec() -> None:
        os.sched_setaffinity(0, cores)
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no orphans
        except OSError:
            pass

    return preexec


class Server:
    """A server process tree pinned to the server cores; `port` once ready."""

    def __init__(self, kind: str, engine: str, args: argparse.Namespace, workdir: Path) -> None:
        self.kind = kind
        self.num_sent = 0  # requests sent to it so far: the next run numbers its requests on from here
        py = sys.executable
        step_ms = report.sim_step_ms(engine, args.step_ms)
        sim = ["--simulated-engine", str(step_ms)] if step_ms is not None else []
        common = ["--max-num-seqs", "256"]
        if engine == "model":
            common += ["--model", args.model, "--device", args.device,
                       "--kv-cache-memory", args.kv_cache_memory]
        ready = workdir / f"{kind}-{engine}.ready"
        ready.unlink(missing_ok=True)  # (a workdir used before: an old file names an old port)
        self.ready = ready
        if kind.startswith("grpc"):  # "grpc", "grpc-ids" / "grpc-text" (the same server), "grpcN" (N workers)
            workers = int(kind[4:] or "1") if kind not in ("grpc-ids", "grpc-text") else 1
            script = Path(py).parent / "engine-server"
            launcher = [str(script)] if script.exists() else [py, "-m", "engine_server"]
            cmd = [*launcher, "--port", "0", "--ready-file", str(ready),
                   "--log-level", "warning", "--api-workers", str(workers), *sim, *common]
        elif kind == "sse":
            cmd = [py, str(BENCH / "sse_server.py"), "--port", "0", "--ready-file", str(ready), *sim, *common]
        else:
            cmd = [py, "-m", "frontend_lib.inproc", *sim, *common, "--prompt", str(args.prompt),
                   "--output", str(args.output)]
        self.command = cmd
        self.log = (workdir / f"{kind}-{engine}.log").open("wb")
        self.process = subprocess.Popen(
            cmd, env=_env(), cwd=ROOT, preexec_fn=_pinned(args.server_cores), stderr=self.log,
            stdin=subprocess.PIPE if kind == "inproc" else subprocess.DEVNULL,
            stdout=subprocess.PIPE if kind == "inproc" else self.log,
        )
        self.port = self._wait_ready()
        self.pids = descendants(self.process.pid)
        # NOTE: the engine core names its process (server/engine_server/proc_title.py); everything else in the
        # tree is frontend (for the in-process row: the client's process, AsyncEngine and the client loop)
        self.core_pids = {pid for pid in self.pids if process_name(pid) == ENGINE_CORE}

    def _wait_ready(self) -> int:
        deadline = time.monotonic() + READY_TIMEOUT_S
        if self.kind == "inproc":
            assert self.process.stdout is not None
            line = self.process.stdout.readline()  # bounded by the process: it prints or exits
            if not line:
                raise RuntimeError(f"in-process runner exited: see {self.log.name}")
            return 0
        while time.monotonic() < deadline:
            if self.ready.exists():
                return int(json.loads(self.ready.read_text())["port"])
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"{self.kind} server exited ({code}): see {self.log.name}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.kind} server not ready in {READY_TIMEOUT_S} s")

    def run_load(self, concurrency: int, num_requests: int, args: argparse.Namespace) -> dict[str, Any]:
        # NOTE: every request this server gets has a prompt of its own (workload.prompt_ids): a round must not
        # find an earlier round's prompts in the prefix cache
        first, self.num_sent = self.num_sent, self.num_sent + num_requests
        if self.kind == "inproc":
            assert self.process.stdin is not None
            assert self.process.stdout is not None
            self.process.stdin.write(f"{concurrency} {num_requests} {first}\n".encode())
            self.process.stdin.flush()
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"in-process runner exited: see {self.log.name}")
            result: dict[str, Any] = json.loads(line)
            return result
        protocol = "grpc" if self.kind.startswith("grpc") else self.kind
        cmd = [sys.executable, "-m", "frontend_lib.loadgen", protocol, "--port", str(self.port),
               "--concurrency", str(concurrency), "--num-requests", str(num_requests),
               "--prompt", str(args.prompt), "--output", str(args.output),
               "--tag", f"c{concurrency}-{time.time_ns()}", "--first-request", str(first)]
        if self.kind == "grpc-ids":
            cmd.append("--ids-only")
        elif self.kind == "grpc-text":
            cmd.append("--text-input")
        done = subprocess.run(cmd, env=_env(), cwd=ROOT, preexec_fn=_pinned({args.client_core}),
                              capture_output=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"load generator failed: {done.stderr.decode()[-2000:]}")
        result = json.loads(done.stdout)
        return result

    def stop(self) -> None:
        if self.kind == "inproc" and self.process.stdin is not None:
            self.process.stdin.close()
        else:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.log.close()


def num_requests(concurrency: int, step_ms: float | None, quick: bool) -> int:
    """Requests per run: whole waves (one request per stream each); `step_ms`: the simulated engine's step."""
    if quick:
        return max(concurrency, 4)
    # NOTE: simulated engine: ~5 s per run at 256 streams (1 ms steps: 30 waves, 5 ms: 10). A run's start
    # (every stream admitted at once) and end (the last wave draining) are not steady serving and weigh on
    # short runs: at 1 ms steps, 10 waves (~1.7 s) gave engine-server ~150k tokens/s and the in-process row
    # ~172k (0.87x), 30 waves ~155k and ~169k (0.92x; 2-3 rounds of each, minutes apart).
    waves = 3 if step_ms is None else max(10, round(30 / step_ms))
    return max(waves * concurrency, 8)


def measure(server: Server, engine: str, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    before = cpu_seconds(server.pids)
    result = server.run_load(
        concurrency, num_requests(concurrency, report.sim_step_ms(engine, args.step_ms), args.quick), args
    )
    spent = {pid: seconds - before.get(pid, 0.0) for pid, seconds in cpu_seconds(server.pids).items()}
    busy_s = sum(spent.values())
    core_s = sum(seconds for pid, seconds in spent.items() if pid in server.core_pids)
    per_token = 1e6 / max(1, result["num_tokens"])
    row = {"engine": engine, "server": server.kind, "concurrency": concurrency, **result,
           "server_cpu_us_per_token": busy_s * per_token,
           "frontend_cpu_us_per_token": (busy_s - core_s) * per_token if server.core_pids else math.nan,
           "core_cpu_us_per_token": core_s * per_token if server.core_pids else math.nan,
           "server_cpu_pct": 100.0 * busy_s / result["wall_s"],
           "messages_per_request": result["num_messages"] / max(1, result["num_requests"])}
    if server.kind == "inproc":
        row["client_cpu_pct"] = None  # the client is inside the measured process
    print(f"   {server.kind:<7} c={concurrency:<4} {row['tokens_per_s']:8.0f} tok/s  TTFT p99 "
          f"{row['ttft_p99_ms']:7.0f} ms  server {row['server_cpu_us_per_token']:6.1f} (frontend "
          f"{row['frontend_cpu_us_per_token']:.1f}) "
          f"us/tok ({row['server_cpu_pct']:.0f}%)  loadgen {_pct(row['client_cpu_pct'])}", flush=True)
    return row


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def run_all(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """Per engine: every server up at once (idle ones cost nothing), then per concurrency the servers take
    turns, `rounds` times in rotating order, so a busy moment on the machine does not land on one of them;
    each server's best round is kept, with every round's target metrics (`rounds`, in round order: round i
    of two servers ran minutes apart at most, so their ratio is a paired reading)."""
    rows: list[dict[str, Any]] = []
    for engine in args.engines:
        print(f"== {engine}: starting {', '.join(args.servers)}", flush=True)
        servers: list[Server] = []
        try:
            for kind in args.servers:
                servers.append(Server(kind, engine, args, workdir))
            for server in servers:
                server.run_load(2, 2, args)  # warm-up (first requests, lazy imports): not measured
            # NOTE: the tiny model too: one round of 3 waves read anywhere between 1.24x and 1.40x the SSE
            # server within an hour on the same code (its rounds are short: ~5 s per server at 256 streams)
            rounds = 1 if args.quick else args.rounds
            for concurrency in args.concurrency:
                best: dict[str, dict[str, Any]] = {}
                every: dict[str, list[dict[str, float]]] = {server.kind: [] for server in servers}
                for round_index in range(rounds):
                    shift = round_index % len(servers)
                    for server in servers[shift:] + servers[:shift]:
                        row = measure(server, engine, concurrency, args)
                        every[server.kind].append({key: row[key] for key in report.ROUND_KEYS})
                        if server.kind not in best or row["tokens_per_s"] > best[server.kind]["tokens_per_s"]:
                            best[server.kind] = row
                for server in servers:
                    best[server.kind]["rounds"] = every[server.kind]
                rows.extend(best[server.kind] for server in servers)
        finally:
            for server in servers:
                server.stop()
    return rows


def _gpu_note(args: argparse.Namespace) -> str:
    if "model" not in args.engines or not args.device.startswith("cuda"):
        return ""
    try:
        query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        gpu = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        gpu = "unknown GPU"
    return (f" Model engine: {args.model} on {args.device} ({gpu}), KV cache {args.kv_cache_memory}; "
            "its engine core process drives the GPU from one of the server cores.")


def _python() -> str:
    venv = ROOT / ".venv"
    return ".venv/bin/python" if Path(sys.prefix).resolve() == venv.resolve() else "python3"


def _cores(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def render(rows: list[dict[str, Any]], args: argparse.Namespace, plots: dict[str, Path]) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    command = "bench/frontend.py " + shlex.join(sys.argv[1:])
    top = max(args.concurrency)
    parts = [
        f"Measured {now} on {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}. "
        f"Command: `{_python()} {command}`. Machine load average (1 min) at the start and end of the "
        f"run: {args.load_before:.1f} / {os.getloadavg()[0]:.1f} (the machine is shared: other processes "
        "compete for both cores, which is why CPU time per token is reported next to throughput).",
        f"Server side (frontend + engine core process) pinned to core(s) {_cores(args.server_cores)}; "
        f"load generator in its own process pinned to core {args.client_core}. Every request: "
        f"{args.prompt}-token prompt, {args.output} generated tokens (greedy, ignore_eos), closed loop (each "
        "stream sends its next request when the previous one ends). Simulated engine: a fixed time per step "
        "(in its label), one token per running sequence. "
        "Server CPU = utime+stime of the server's whole process tree (/proc/PID/stat) per generated token; "
        "for the in-process row it includes the client's own work; \"of which frontend\": all but the engine "
        "core process." + _gpu_note(args),
        f"### Targets at {top} streams", report.targets(rows, concurrency=top, step_ms=args.step_ms),
        f"TTFT at {top} streams, the first wave (every stream's first request, all sent at once: one burst "
        "of prefills) and the requests after it (not targets; the targets above are on whole runs):",
        report.first_wave(rows, concurrency=top, step_ms=args.step_ms),
        f"Server CPU per generated token at {top} streams, frontend process(es) vs engine core process (the "
        "core names its process: server/engine_server/proc_title.py), on each server's best round, then the "
        "range over its rounds:",
        report.cpu_split(rows, concurrency=top, step_ms=args.step_ms),
    ]
    for engine in args.engines:
        label = report.engine_label(engine, args.step_ms)
        parts.append(f"### {label[0].upper() + label[1:]}")
        parts.append(report.table(rows, engine))
        if engine in plots:
            rel = os.path.relpath(plots[engine], Path(args.markdown).resolve().parent)
            parts.append(f"![{engine}]({rel})")
    return "\n\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: fewer requests, concurrency 1 and 16")
    p.add_argument("--engines", default="sim,sim5,tiny",
                   help="sim: simulated engine at --step-ms; simN: at N ms per step; tiny: the real engine")
    p.add_argument("--servers", default="grpc,grpc-ids,sse,inproc",
                   help="grpc = engine-server; grpc-ids = the same, the client asks for token ids only "
                        "(return_text=false); grpc-text = the same, the client sends its prompts as text; "
                        "grpcN = engine-server --api-workers N; sse; inproc")
    p.add_argument("--concurrency", default=None, help="default 1,16,64,256 (quick: 1,16)")
    p.add_argument("--step-ms", type=float, default=1.0)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--output", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2, help="turns per server and concurrency (best kept)")
    p.add_argument("--markdown", default=None, help="write the section into this file (e.g. BENCHMARKS.md)")
    p.add_argument("--plots", default=str(ROOT / "docs" / "bench"), help="folder for the PNG plots")
    p.add_argument("--json", default=None, help="write the raw rows here")
    p.add_argument("--model", default=None, help="engine 'model': this model directory")
    p.add_argument("--device", default="cpu", help="engine 'model': cpu, cuda or cuda:N")
    p.add_argument("--kv-cache-memory", default="4GiB", help="engine 'model': the KV cache's size")
    p.add_argument("--server-cores", default="0", help="cores of the server side (frontend + engine core)")
    p.add_argument("--client-core", type=int, default=1, help="the load generator's core")
    p.add_argument("--section", default="", help="a BENCHMARKS.md section of its own (e.g. 'gpu')")
    args = p.parse_args()
    args.server_cores = {int(c) for c in args.server_cores.split(",")}
    if "model" in args.engines.split(","):
        if not args.model:
            p.error("engine 'model' needs --model DIR")
        report.ENGINE_LABELS["model"] = f"{Path(args.model).name} on {args.device}"
    args.engines = args.engines.split(",")
    args.servers = args.servers.split(",")
    default = "1,16" if args.quick else "1,16,64,256"
    args.concurrency = [int(c) for c in (args.concurrency or default).split(",")]
    cores = {*args.server_cores, args.client_core}
    if args.client_core in args.server_cores or not cores <= os.sched_getaffinity(0):
        sys.exit("needs 2 cores: one for the server, one for the load generator (see --server-cores)")
    args.load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="frontend-bench-") as tmp:
        try:
            rows = run_all(args, Path(tmp))
        except Exception:
            for log in sorted(Path(tmp).glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    plots: dict[str, Path] = {}
    if args.markdown:
        for engine in args.engines:
            suffix = f"-{args.section}" if args.section else ""
            plots[engine] = Path(args.plots).resolve() / f"frontend-{engine}{suffix}.png"
            report.plot(rows, engine, plots[engine], step_ms=args.step_ms)
        tag = f"frontend_bench{':' + args.section if args.section else ''}"
        heading = "## Frontend throughput" + (f" ({args.section})" if args.section else "")
        report.write_section(Path(args.markdown), render(rows, args, plots), start=f"<!-- {tag}:start -->",
                             end=f"<!-- {tag}:end -->", heading=heading)
    print(render(rows, args, plots))


if __name__ == "__main__":
    main()
