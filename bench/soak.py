#!/usr/bin/env python3
"""Memory soak (issue 37, item 4): does `engine-server` hold on to anything per request? Not a test.

Starts `engine-server` (the tiny model, and/or `--simulated-engine 1`: the frontend alone), drives N short
requests with C concurrent callers over a few HTTP/2 connections (re-opened every --reconnect-every requests),
and samples the frontend's and the engine core's RSS every K requests. The mix, one in every ten calls each:
engine.v1 Generate streamed (token ids x2, text x2), unary (token ids, text), the vLLM-compatible Generate
(streamed, then unary, by turns), GetLoad, Tokenize, and streamed token ids again with a request id of the
client's; every Generate asks for 2-4 tokens of a prompt of 4-12 tokens (or words), temperature 1 with a seed.

The verdict is the slope of RSS over requests after warm-up (least squares, bytes per 1,000 requests), per
process; the target is under 1 KiB per 1,000 (BENCHMARKS.md, "## Reliability").

Usage: soak.py [--engines tiny,simulated] [--requests 100000] [--concurrency 12] [--sample-every 500]
               [--warmup 20000] [--json PATH] [-- extra engine-server flags]
Run it with PYTHONPATH pointing at another copy of server/ (and gen/python, clients/python/src) to measure
that one: the server it starts imports `engine_server` from there. Every sample goes to --json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from engine_proto.engine.v1 import generate_pb2, info_pb2, tokenize_pb2  # noqa: E402
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub  # noqa: E402
from grpclib.client import Channel  # noqa: E402
from grpclib.const import Cardinality  # noqa: E402
from serverproc import RunningServer, process_name, start_server  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb  # noqa: E402

CALL_TIMEOUT_S = 30.0
VLLM_GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "rain", "falls")
ENGINE_ARGS = {
    "tiny": ("--num-threads", "1"),
    "simulated": ("--simulated-engine", "1"),
}


@dataclass(frozen=True, slots=True)
class Sample:
    requests: int  # completed when sampled
    seconds: float  # since the first request
    frontend_rss_kib: int
    frontend_anon_kib: int
    core_rss_kib: int | None  # None: no engine core process (--in-process-engine)
    core_anon_kib: int | None


@dataclass(slots=True)
class Run:
    engine: str
    requests: int
    concurrency: int
    wall_s: float = 0.0
    errors: int = 0
    samples: list[Sample] = field(default_factory=list)


def _status_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) of a process in KiB, from /proc/PID/status."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            values[key] = int(rest.split()[0])
    return values["VmRSS"], values["RssAnon"]


def _core_pid(server: RunningServer) -> int | None:
    cores = server.pids_named("engine-core")
    return cores[0] if cores else None


def _prompt_ids(i: int) -> list[int]:
    return [20 + (i * 7 + k * 13) % 200 for k in range(4 + i % 9)]


def _prompt_text(i: int) -> str:
    return " ".join(WORDS[(i + k * 5) % len(WORDS)] for k in range(4 + i % 9))


def _generate_request(
    i: int, *, stream: bool, text: bool, request_id: str = ""
) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(request_id=request_id, stream=stream)
    if text:
        request.text = _prompt_text(i)
    else:
        request.token_ids.ids.extend(_prompt_ids(i))
    request.sampling.temperature = 1.0
    request.sampling.seed = i
    request.stopping.max_tokens = 2 + i % 3
    request.stopping.ignore_eos = True
    return request


class Caller:
    """One caller: its connection (shared with others), the calls of the mix."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.stub = EngineServiceStub(channel)

    async def call(self, i: int) -> None:
        kind, stub, timeout = i % 10, self.stub, CALL_TIMEOUT_S
        if kind < 4:
            await stub.Generate(_generate_request(i, stream=True, text=kind >= 2), timeout=timeout)
        elif kind < 6:
            await stub.Generate(_generate_request(i, stream=False, text=kind == 5), timeout=timeout)
        elif kind == 6:
            await self._vllm_generate(i, stream=(i // 10) % 2 == 0)
        elif kind == 7:
            await stub.GetLoad(info_pb2.GetLoadRequest(), timeout=timeout)
        elif kind == 8:
            await stub.Tokenize(tokenize_pb2.TokenizeRequest(text=_prompt_text(i)), timeout=timeout)
        else:
            request = _generate_request(i, stream=True, text=False, request_id=f"soak-{i}")
            await stub.Generate(request, timeout=timeout)

    async def _vllm_generate(self, i: int, *, stream: bool) -> None:
        request = vllm_pb.GenerateRequest(
            request_id=f"vllm-{i}", tokenized=vllm_pb.TokenizedInput(input_ids=_prompt_ids(i)), stream=stream,
            sampling_params=vllm_pb.SamplingParams(temperature=1.0, seed=i, max_tokens=2 + i % 3,
                                                   ignore_eos=True),
        )
        async with self.channel.request(VLLM_GENERATE, Cardinality.UNARY_STREAM, vllm_pb.GenerateRequest,
                                        vllm_pb.GenerateResponse, timeout=CALL_TIMEOUT_S) as call:
            await call.send_message(request, end=True)
            while await call.recv_message() is not None:
                pass


async def soak(
    server: RunningServer, *, engine: str, requests: int, concurrency: int, connections: int,
    sample_every: int, reconnect_every: int, progress: Callable[[Sample], None],
) -> Run:
    run = Run(engine, requests, concurrency)
    frontend_pid, core_pid = server.process.pid, _core_pid(server)
    channels = [Channel("127.0.0.1", server.port) for _ in range(connections)]
    counter = itertools.count()
    done = 0
    start = time.monotonic()

    retired: list[tuple[Channel, int]] = []  # (a replaced connection, `done` when it was replaced)

    def sample() -> None:
        # (a replaced connection is closed once the calls that were on it have surely ended)
        for channel, done_then in list(retired):
            if done - done_then >= 1000:
                channel.close()
                retired.remove((channel, done_then))
        rss, anon = _status_kib(frontend_pid)
        core = _status_kib(core_pid) if core_pid is not None else (None, None)
        taken = Sample(done, time.monotonic() - start, rss, anon, core[0], core[1])
        run.samples.append(taken)
        progress(taken)

    async def caller(index: int) -> None:
        nonlocal done
        while (i := next(counter)) < requests:
            slot = index % connections
            # 1) now and then a connection is replaced: per-connection state must go with it
            if reconnect_every and i % reconnect_every == reconnect_every - 1:
                retired.append((channels[slot], done))
                channels[slot] = Channel("127.0.0.1", server.port)
            try:
                await Caller(channels[slot]).call(i)
            except Exception as error:  # (counted and shown; the soak goes on)
                run.errors += 1
                if run.errors <= 5:
                    print(f"request {i}: {type(error).__name__}: {error}", file=sys.stderr)
            done += 1
            if done % sample_every == 0:
                sample()

    sample()
    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    run.wall_s = time.monotonic() - start
    for channel in (*channels, *(channel for channel, _ in retired)):
        channel.close()
    return run


def slope_per_1000(points: Sequence[tuple[int, int]]) -> float:
    """Least-squares slope of (requests, KiB) points, in bytes per 1,000 requests."""
    n = len(points)
    if n < 2:
        return float("nan")
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var_x = sum((x - mean_x) ** 2 for x, _ in points)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return cov / var_x * 1024 * 1000


def summarize(run: Run, *, warmup: int) -> dict[str, Any]:
    after = [s for s in run.samples if s.requests >= warmup]
    summary: dict[str, Any] = {
        "engine": run.engine, "requests": run.requests, "concurrency": run.concurrency,
        "wall_s": round(run.wall_s, 1), "errors": run.errors, "warmup": warmup,
    }
    series: dict[str, Callable[[Sample], int | None]] = {
        "frontend_rss": lambda s: s.frontend_rss_kib, "frontend_anon": lambda s: s.frontend_anon_kib,
        "core_rss": lambda s: s.core_rss_kib, "core_anon": lambda s: s.core_anon_kib,
    }
    for name, get in series.items():
        points = [(s.requests, value) for s in after if (value := get(s)) is not None]
        if not points:
            continue
        summary[f"{name}_slope_b_per_1000"] = round(slope_per_1000(points), 1)
        summary[f"{name}_kib_at_warmup"] = points[0][1]
        summary[f"{name}_kib_at_end"] = points[-1][1]
        first = get(run.samples[0])
        summary[f"{name}_kib_at_start"] = first
    return summary


async def main_async(args: argparse.Namespace, extra: Sequence[str]) -> list[dict[str, Any]]:
    results = []
    for engine in args.engines.split(","):
        server = start_server(*ENGINE_ARGS[engine], *extra)
        try:
            print(f"# {engine}: frontend pid {server.process.pid} ({process_name(server.process.pid)}), "
                  f"core pid {_core_pid(server)}", file=sys.stderr, flush=True)

            def progress(sample: Sample) -> None:
                print(f"  {sample.requests:>7} requests {sample.seconds:7.1f} s  frontend "
                      f"{sample.frontend_rss_kib} KiB (anon {sample.frontend_anon_kib})  core "
                      f"{sample.core_rss_kib} KiB (anon {sample.core_anon_kib})", file=sys.stderr, flush=True)

            run = await soak(server, engine=engine, requests=args.requests, concurrency=args.concurrency,
                             connections=args.connections, sample_every=args.sample_every,
                             reconnect_every=args.reconnect_every, progress=progress)
        finally:
            server.stop()
        summary = summarize(run, warmup=args.warmup)
        print(json.dumps(summary), flush=True)
        results.append({"summary": summary, "samples": [asdict(s) for s in run.samples]})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="tiny,simulated", help="comma-separated: tiny, simulated")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--sample-every", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20_000, help="requests before the slope is fitted")
    parser.add_argument("--reconnect-every", type=int, default=5000,
                        help="each caller's connection is replaced every N requests (0: never)")
    parser.add_argument("--json", type=Path, help="write every sample and the summaries here")
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    os.environ.setdefault("ENGINE_CACHE_DIR", str(ROOT / ".tools" / "model-cache"))
    import uvloop

    results = uvloop.run(main_async(args, extra))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
