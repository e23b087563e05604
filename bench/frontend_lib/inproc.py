"""The in-process baseline: `AsyncEngine.generate` called directly (no network, no serialization), with its
engine core in its own process as served. Long-lived: prints {"ready": pid} once loaded, then answers each
stdin line "CONCURRENCY NUM_REQUESTS" with one JSON summary line.

Usage: python -m frontend_lib.inproc [--model PATH] [--simulated-engine STEP_MS] [--prompt 100] [--output 100]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time

from engine_server.engine.types import SamplingParams
from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.outputs import GenerateRequest
from engine_server.gc_policy import freeze_startup_heap

from frontend_lib.engine_args import add_engine_args, resolve_model, start_engine
from frontend_lib.workload import RequestTrace, SendFn, closed_loop, cpu_seconds_self, prompt_ids, summarize


def engine_sender(engine: AsyncEngine, *, prompt: int, output: int, tag: str) -> SendFn:
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)

    async def send(i: int, trace: RequestTrace) -> None:
        request = GenerateRequest(f"{tag}-{i}", tuple(prompt_ids(i, prompt)), params)
        arrivals = trace.arrivals
        perf = time.perf_counter
        async with contextlib.aclosing(engine.generate(request)) as outputs:
            async for out in outputs:
                arrivals.append((perf(), sum(len(c.token_ids) for c in out.chunks)))

    return send


async def main_async(args: argparse.Namespace) -> None:
    engine = await start_engine(args)
    # NOTE: the garbage-collector policy engine-server's processes run with (gc_policy.py), so this ceiling is
    # not lowered by collector pauses engine-server avoids
    freeze_startup_heap()
    print(json.dumps({"ready": True, "core_pid": engine.core_pid}), flush=True)
    loop = asyncio.get_running_loop()
    run = 0
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            break
        concurrency, num_requests, first = (int(x) for x in line.split())
        run += 1
        send = engine_sender(engine, prompt=args.prompt, output=args.output, tag=f"run{run}")
        cpu0 = cpu_seconds_self()
        traces, wall_s = await closed_loop(send, concurrency=concurrency, num_requests=num_requests,
                                           first=first)
        summary = summarize(traces, wall_s=wall_s, client_cpu_s=cpu_seconds_self() - cpu0,
                            concurrency=concurrency)
        print(json.dumps(summary.to_json()), flush=True)
    await engine.shutdown(timeout=5.0)


def main() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--output", type=int, default=100)
    args = p.parse_args()
    resolve_model(args)
    import uvloop

    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
