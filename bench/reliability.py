#!/usr/bin/env python3
"""Reliability observations (not a test): what `engine-server` does when its parts die, and at its edges.

Scenarios (each on a fresh server with the tiny model; figures to BENCHMARKS.md, "## Reliability"):
- core-kill: K endless streams run, the engine core gets SIGKILL: the streams' statuses, the load the server
  reports afterwards, whether the core stays a zombie, when (and with which status) the server exits; a
  server still up after --wait seconds gets SIGTERM and its exit status is noted. Also with --api-workers 2.
- worker-kill (--api-workers 2): SIGKILL of worker 1: is it replaced, how soon does the new one serve.
- n8-load: GetLoad while one request with n = 8 runs.
- bind: seconds from launch to the first accepted TCP connection and to the ready file.
- exit-noise: lines of a CPU server's output at shutdown that mention nanobind or leaks (default and
  --in-process-engine).

Usage: reliability.py [--scenarios core-kill,worker-kill,n8-load,bind,exit-noise] [--wait 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from engine_proto.engine.v1 import generate_pb2, info_pb2  # noqa: E402
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub  # noqa: E402
from grpclib.client import Channel  # noqa: E402
from grpclib.exceptions import GRPCError, StreamTerminatedError  # noqa: E402
from serverproc import RunningServer, connection_owner, spawn, start_server  # noqa: E402

TIMEOUT = 60.0


def _endless(request_id: str, *, n: int = 1) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(request_id=request_id, stream=True)
    request.token_ids.ids.extend([20, 21, 22, 23])
    request.sampling.temperature = 1.0
    request.sampling.n = n
    request.stopping.max_tokens = 1500
    request.stopping.ignore_eos = True
    return request


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _wait_exit(server: RunningServer, seconds: float) -> tuple[int | None, float]:
    """(exit status or None if still running after `seconds`, when it was seen: time.monotonic())."""
    try:
        code: int | None = server.process.wait(seconds)
    except subprocess.TimeoutExpired:
        code = None
    return code, time.monotonic()


async def _load(stub: EngineServiceStub) -> str:
    reply = await stub.GetLoad(info_pb2.GetLoadRequest(), timeout=5.0)
    load = reply.load
    return (f"{info_pb2.EngineState.Name(reply.state)} running={load.num_running_requests} "
            f"waiting={load.num_waiting_requests} kv_usage={load.kv_cache_usage:.3f}")


async def core_kill(args: argparse.Namespace, *extra: str) -> None:
    server = start_server("--drain-timeout", "5", *extra)
    channel = Channel("127.0.0.1", server.port)
    stub = EngineServiceStub(channel)
    try:
        streams = []
        for i in range(args.streams):
            stream = stub.Generate.open(timeout=TIMEOUT)
            await stream.__aenter__()
            await stream.send_message(_endless(f"doomed-{i}"), end=True)
            await stream.recv_message()
            streams.append(stream)
        (core,) = server.pids_named("engine-core")
        killed_at = time.monotonic()
        os.kill(core, signal.SIGKILL)
        exited = asyncio.create_task(asyncio.to_thread(_wait_exit, server, args.wait))
        statuses: dict[str, int] = {}
        for stream in streams:
            try:
                async for _ in stream:
                    pass
                await stream.recv_trailing_metadata()  # raises on a status other than OK
                name = "OK"
            except GRPCError as exc:
                name = exc.status.name
            except (StreamTerminatedError, ConnectionError) as exc:
                name = type(exc).__name__
            statuses[name] = statuses.get(name, 0) + 1
        errors_s = time.monotonic() - killed_at
        await asyncio.sleep(0.1)
        core_state = _state(core)
        try:
            load = await _load(stub)
        except (GRPCError, StreamTerminatedError, ConnectionError, OSError) as exc:
            load = f"no answer ({type(exc).__name__})"
        code, seen_at = await exited
        exit_s = seen_at - killed_at
        print(f"core-kill {' '.join(extra) or '(one frontend)'}: streams {statuses} after {errors_s:.2f} s; "
              f"core 0.1 s later: {core_state}; GetLoad then: {load}")
        if code is not None:
            print(f"  server exited by itself with status {code}, {exit_s:.2f} s after the kill")
        else:
            server.send_signal(signal.SIGTERM)
            code, _ = await asyncio.to_thread(_wait_exit, server, TIMEOUT)
            print(f"  server still up {args.wait:.0f} s after the kill; SIGTERM then: exit status {code}")
    finally:
        channel.close()
        if server.process.poll() is None:
            server.stop()


async def worker_kill(args: argparse.Namespace) -> None:
    with start_server("--api-workers", "2", "--metrics-port", "0") as server:
        (worker,) = server.pids_named("engine-api-1")
        killed_at = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        new: list[int] = []
        deadline = killed_at + args.wait
        while time.monotonic() < deadline and not new:
            new = [pid for pid in server.pids_named("engine-api-1") if pid != worker]
            await asyncio.sleep(0.05)
        if not new:
            print(f"worker-kill: no new worker within {args.wait:.0f} s; old one: {_state(worker)}; "
                  f"log lines about it: {_log_lines(server, 'worker')}")
            return
        started_s = time.monotonic() - killed_at
        await _first_served_by(server, new[0], deadline=killed_at + args.wait)
        served_s = time.monotonic() - killed_at
        print(f"worker-kill: new worker process after {started_s:.2f} s, its first answer {served_s:.2f} s "
              f"after the kill; log: {_log_lines(server, 'worker')}")


async def _first_served_by(server: RunningServer, pid: int, *, deadline: float) -> float:
    """Seconds until a new connection lands on `pid` and its GetLoad says SERVING (nan: not by `deadline`)."""
    started = time.monotonic()
    while time.monotonic() < deadline:
        channel = Channel("127.0.0.1", server.port)
        try:
            reply = await EngineServiceStub(channel).GetLoad(info_pb2.GetLoadRequest(), timeout=5.0)
            if reply.state == info_pb2.ENGINE_STATE_SERVING and connection_owner(channel) == pid:
                return time.monotonic() - started
        except (GRPCError, StreamTerminatedError, ConnectionError, OSError):
            pass
        finally:
            channel.close()
        await asyncio.sleep(0.02)
    return float("nan")


def _log_lines(server: RunningServer, word: str) -> list[str]:
    return [line.split(" ", 2)[-1][:160] for line in server.log().splitlines()
            if word in line and any(level in line for level in ("ERROR", "WARNING", "serves again"))]


async def n8_load(args: argparse.Namespace) -> None:
    with start_server() as server:
        channel = Channel("127.0.0.1", server.port)
        try:
            stub = EngineServiceStub(channel)
            async with stub.Generate.open(timeout=TIMEOUT) as stream:
                await stream.send_message(_endless("n8", n=8), end=True)
                await stream.recv_message()
                reply = await stub.GetLoad(info_pb2.GetLoadRequest(), timeout=5.0)
                fields = {name: getattr(reply.load, name) for name in ("num_running_requests",
                          "num_waiting_requests", "num_running_completions") if hasattr(reply.load, name)}
                print(f"n8-load: GetLoad with one n = 8 request running: {fields}")
                await stream.cancel()
        finally:
            channel.close()


def bind(args: argparse.Namespace) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workdir = Path(tempfile.mkdtemp(prefix="reliability-"))
    ready = workdir / "ready.json"
    command = [str(Path(sys.executable).parent / "engine-server"), "--port", str(port),
               "--ready-file", str(ready)]
    launched = time.monotonic()
    process = spawn(command, log_path=workdir / "server.log")
    bound = None
    while not ready.exists() and time.monotonic() - launched < TIMEOUT:
        if bound is None:
            with socket.socket() as client:
                if client.connect_ex(("127.0.0.1", port)) == 0:
                    bound = time.monotonic() - launched
        time.sleep(0.01)
    ready_s = time.monotonic() - launched
    process.send_signal(signal.SIGTERM)
    process.wait(TIMEOUT)
    assert json.loads(ready.read_text())["port"] == port
    bound_text = "never" if bound is None else f"{bound:.2f} s after launch"
    print(f"bind: first TCP connection accepted {bound_text}; ready file after {ready_s:.2f} s")


def exit_noise(args: argparse.Namespace) -> None:
    for extra in ((), ("--in-process-engine",)):
        server = start_server(*extra)
        server.stop()
        lines = [line for line in server.log().splitlines() if "nanobind" in line or "leaked" in line]
        print(f"exit-noise {' '.join(extra) or '(own core process)'}: exit status {server.returncode}, "
              f"{len(lines)} nanobind/leak lines of {len(server.log().splitlines())}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="core-kill,worker-kill,n8-load,bind,exit-noise")
    parser.add_argument("--streams", type=int, default=8, help="core-kill: streams in flight")
    parser.add_argument("--wait", type=float, default=20.0, help="seconds to wait for an exit / a new worker")
    args = parser.parse_args()
    for scenario in args.scenarios.split(","):
        if scenario == "core-kill":
            await core_kill(args)
            await core_kill(args, "--api-workers", "2")
        elif scenario == "worker-kill":
            await worker_kill(args)
        elif scenario == "n8-load":
            await n8_load(args)
        elif scenario == "bind":
            await asyncio.to_thread(bind, args)
        elif scenario == "exit-noise":
            await asyncio.to_thread(exit_noise, args)
        else:
            parser.error(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    asyncio.run(main())
