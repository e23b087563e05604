"""Transport choice on the real engine: the same `AsyncEngine` (tiny model, core in its own process, 1 torch
thread) served through (a) grpclib + `_pb2` (the shipped servicer), (b) grpclib + betterproto2, (c) grpcio.aio
+ `_pb2`, one at a time. The server process (and its engine core) is pinned to core 0, the load generator
(`frontend_lib.loadgen`: grpclib + `_pb2` by default, one HTTP/2 connection) to core 1. A benchmark, not a
test (tests/perf/test_transport_bench_smoke.py keeps it working).

Per transport and concurrency: tokens/s, TTFT p50/p99, CPU microseconds per streamed chunk of the serving
process alone (utime+stime from /proc/PID/stat) and of the engine core process, ratios vs (a).

Usage: .venv/bin/python bench/transport_bench.py [--quick] [--out docs/bench/transport.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from frontend_lib.procstat import tree_cpu_seconds  # noqa: E402
from transport_lib.servicers import TRANSPORTS  # noqa: E402

CONCURRENCIES = (16, 64, 256)
LABELS = {"grpclib-pb2": "(a) grpclib + `_pb2` (shipped)", "grpclib-bp2": "(b) grpclib + betterproto2",
          "grpcio-pb2": "(c) grpcio.aio + `_pb2`"}


# --- the server process ---------------------------------------------------------------------------------

async def serve(kind: str, model: str) -> None:
    from engine_server.engine.config import EngineConfig
    from engine_server.frontend.async_engine import AsyncEngine
    from transport_lib.servicers import start_transport

    engine = await AsyncEngine.start(EngineConfig(model=model, num_threads=1))
    port, stop = await start_transport(kind, engine)
    print(json.dumps({"port": port, "pid": os.getpid(), "core_pid": engine.core_pid}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # the parent closes stdin to stop us
    await stop()
    await engine.shutdown(timeout=5.0)


# --- the driver -----------------------------------------------------------------------------------------

def loadgen(port: int, *, concurrency: int, num_requests: int, tag: str, client: str) -> dict[str, Any]:
    cmd = ["taskset", "-c", "1", sys.executable, "-m", "frontend_lib.loadgen", "grpc", "--port", str(port),
           "--concurrency", str(concurrency), "--num-requests", str(num_requests), "--tag", tag,
           "--grpc-client", client]
    out = subprocess.run(cmd, cwd=BENCH, capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"loadgen failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def run_transport(
    kind: str, *, model: str, concurrencies: tuple[int, ...], scale: int, client: str
) -> list[dict[str, Any]]:
    cmd = ["taskset", "-c", "0", sys.executable, str(Path(__file__).resolve()), "--serve", kind,
           "--model", model]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        info = json.loads(proc.stdout.readline())
        loadgen(info["port"], concurrency=16, num_requests=32, tag=f"{kind}-warm", client=client)
        for concurrency in concurrencies:
            num_requests = max(32, scale * concurrency)
            server0, core0 = tree_cpu_seconds([info["pid"]]), tree_cpu_seconds([info["core_pid"]])
            row = loadgen(info["port"], concurrency=concurrency, num_requests=num_requests,
                          tag=f"{kind}-{concurrency}", client=client)
            server_s = tree_cpu_seconds([info["pid"]]) - server0
            core_s = tree_cpu_seconds([info["core_pid"]]) - core0
            row.update(transport=kind, concurrency=concurrency,
                       server_cpu_us_per_chunk=server_s * 1e6 / row["num_messages"],
                       server_cpu_us_per_token=server_s * 1e6 / row["num_tokens"],
                       server_cpu_pct=100.0 * server_s / row["wall_s"],
                       core_cpu_us_per_token=core_s * 1e6 / row["num_tokens"],
                       tokens_per_chunk=row["num_tokens"] / row["num_messages"])
            rows.append(row)
            print(f"{kind:12s} c={concurrency:3d} {row['tokens_per_s']:7.0f} tok/s  TTFT p50 "
                  f"{row['ttft_p50_ms']:6.0f} p99 {row['ttft_p99_ms']:6.0f} ms  "
                  f"{row['server_cpu_us_per_chunk']:5.0f} us/chunk, server {row['server_cpu_pct']:.0f}% "
                  f"loadgen {row['client_cpu_pct']:.0f}% core {core_s * 100 / row['wall_s']:.0f}%",
                  file=sys.stderr, flush=True)
        proc.stdin.close()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    ref = {r["concurrency"]: r for r in rows if r["transport"] == "grpclib-pb2"}
    lines = ["| transport | streams | tok/s | x (a) | TTFT p50 ms | TTFT p99 ms | tokens/chunk | "
             "server CPU us/chunk | x (a) | server CPU % | core CPU us/token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["concurrency"], TRANSPORTS.index(r["transport"]))):
        a = ref.get(r["concurrency"], r)
        lines.append(
            f"| {LABELS[r['transport']]} | {r['concurrency']} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / a['tokens_per_s']:.2f} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | "
            f"{r['tokens_per_chunk']:.2f} | {r['server_cpu_us_per_chunk']:.0f} | "
            f"{r['server_cpu_us_per_chunk'] / a['server_cpu_us_per_chunk']:.2f} | "
            f"{r['server_cpu_pct']:.0f} | "
            f"{r['core_cpu_us_per_token']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--serve", choices=TRANSPORTS, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None)
    p.add_argument("--quick", action="store_true", help="fewer requests per point (about a minute in all)")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCIES))
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    p.add_argument("--grpc-client", choices=("grpclib", "h2"), default="grpclib",
                   help="load generator's client: grpclib + _pb2, or frontend_lib's raw HTTP/2 + _pb2")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args()
    if args.model is None:
        from engine_server.models.tiny import default_model_dir

        args.model = str(default_model_dir())
    if args.serve is not None:
        if args.serve == "grpcio-pb2":
            asyncio.run(serve(args.serve, args.model))  # grpcio.aio runs on the stock asyncio loop
        else:
            import uvloop  # as engine-server runs grpclib

            uvloop.run(serve(args.serve, args.model))
        return
    started = time.monotonic()
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    for kind in args.transports:
        rows += run_transport(kind, model=args.model, concurrencies=tuple(args.concurrency),
                              scale=1 if args.quick else 2, client=args.grpc_client)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, after "
          f"{load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}; "
          f"{time.monotonic() - started:.0f} s\n")
    print(table(rows))
    if args.out is not None:
        args.out.write_text(json.dumps({"load_before": load_before, "load_after": load_after, "rows": rows},
                                       indent=1))


if __name__ == "__main__":
    main()
