#!/usr/bin/env python3
"""Tokenizer flood (not a test): one client floods huge texts, another measures what everyone else sees.

Per server (the tiny model, engine core in its own process; the frontend alone on core 0, the rest on core 1),
in one run:
1) quiet: the prober alone for --seconds: GetLoad round trips back to back (p50 / p99 / max) and, on a
   connection of its own, streamed token-id Generates one after another (10-token prompt, 4 tokens: TTFT
   p50 / p99);
2) flood (--floods times): the same prober while a flooder process (10 nice levels lower) sends, from
   --flooders concurrent streams back to back, Generate(text) and Tokenize(text) requests of --text-mb MB
   each (natural text from the tiny tokenizer's corpus, a different mix per request) and Tokenize requests
   with a text under the context's bound (tokenized for real, on the worker pool where there is one);
3) after each flood: the frontend's RSS once the server has been idle for --settle seconds.

`--baseline DIR` also runs the same on a server started from DIR (e.g. a `git worktree` of the previous
commit), in the same run, taking turns with this tree's server; `--markdown BENCHMARKS.md` appends (or
replaces) this section under "## Reliability" (other subsections stay).

Usage: tokenize_flood.py [--seconds 15] [--floods 2] [--flooders 1] [--text-mb 4] [--baseline DIR]
                         [--markdown FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from engine_server.proc_title import ENGINE_CORE  # noqa: E402
from frontend_lib.procstat import descendants, process_name  # noqa: E402

FRONTEND_CORE, CLIENT_CORE = 0, 1
CORPUS = ROOT / "server" / "engine_server" / "models" / "corpus.py"
TIMEOUT_S = 120.0
SECTION = "### Tokenizer flood (issue 37, item 1"  # the heading goes on: date, machine


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class CpuWait:
    """Since it was made: the share of wall time in which the frontend's event-loop thread was runnable but
    waiting for its core (/proc/PID/schedstat: other processes on a shared machine took it)."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._wall, self._waited = time.monotonic(), self._read()

    def _read(self) -> float:
        try:
            return int(Path(f"/proc/{self._pid}/schedstat").read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return float("nan")

    def percent(self) -> float:
        return 100.0 * (self._read() - self._waited) / (time.monotonic() - self._wall)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def natural_text(num_chars: int, seed: int) -> str:
    """Words of the tiny tokenizer's training corpus in a seeded random order, `num_chars` characters."""
    words = CORPUS.read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_chars:
        run = words[rng.randrange(len(words)):][:200]
        parts.append(" ".join(run))
        size += len(parts[-1]) + 1
    return " ".join(parts)[:num_chars]


# --- the client processes -------------------------------------------------------------------------


async def _probe(port: int, seconds: float) -> dict[str, Any]:
    from engine_proto.engine.v1 import generate_pb2, info_pb2
    from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
    from grpclib.client import Channel

    load_channel, gen_channel = Channel("127.0.0.1", port), Channel("127.0.0.1", port)
    load_stub, gen_stub = EngineServiceStub(load_channel), EngineServiceStub(gen_channel)
    deadline = time.perf_counter() + seconds
    load_ms: list[float] = []
    ttft_ms: list[float] = []
    errors: list[str] = []

    async def loads() -> None:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            await load_stub.GetLoad(info_pb2.GetLoadRequest(), timeout=TIMEOUT_S)
            load_ms.append((time.perf_counter() - start) * 1e3)
            await asyncio.sleep(0.005)

    async def generates() -> None:
        i = 0
        while time.perf_counter() < deadline:
            request = generate_pb2.GenerateRequest(stream=True)
            request.token_ids.ids.extend(16 + (i * 37 + k * 11) % 1000 for k in range(10))
            request.sampling.temperature = 0.0
            request.stopping.max_tokens = 4
            request.stopping.ignore_eos = True
            i += 1
            start = time.perf_counter()
            first = None
            try:
                async with gen_stub.Generate.open(timeout=TIMEOUT_S) as stream:
                    await stream.send_message(request, end=True)
                    async for response in stream:
                        if first is None and any(c.token_ids for c in response.completions):
                            first = time.perf_counter()
            except Exception as exc:  # reported, not fatal: the run shows what failed
                errors.append(f"{type(exc).__name__}: {exc}")
            if first is not None:
                ttft_ms.append((first - start) * 1e3)
            await asyncio.sleep(0.005)

    try:
        await asyncio.gather(loads(), generates())
    finally:
        load_channel.close()
        gen_channel.close()
    return {"getload_ms": load_ms, "ttft_ms": ttft_ms, "errors": errors[:5]}


async def _flood(port: int, seconds: float, flooders: int, text_mb: float, fit_chars: int) -> dict[str, Any]:
    from engine_proto.engine.v1 import generate_pb2, tokenize_pb2
    from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
    from grpclib.client import Channel
    from grpclib.exceptions import GRPCError

    # NOTE: built before the clock starts (tens of MB of text; the flood must not wait for its client)
    big = [natural_text(int(text_mb * 1e6), seed) for seed in range(4)]
    fitting = [natural_text(fit_chars, 100 + seed) for seed in range(8)]
    channels = [Channel("127.0.0.1", port) for _ in range(flooders)]
    results: dict[str, list[tuple[str, float]]] = {"generate": [], "tokenize": [], "tokenize_fit": []}
    deadline = time.perf_counter() + seconds

    async def one(kind: str, stub: EngineServiceStub, i: int) -> None:
        start = time.perf_counter()
        status = "OK"
        try:
            if kind == "generate":
                request = generate_pb2.GenerateRequest(text=big[i % len(big)])
                request.stopping.max_tokens = 4
                await stub.Generate(request, timeout=TIMEOUT_S)
            elif kind == "tokenize":
                await stub.Tokenize(tokenize_pb2.TokenizeRequest(text=big[i % len(big)]), timeout=TIMEOUT_S)
            else:
                await stub.Tokenize(tokenize_pb2.TokenizeRequest(text=fitting[i % len(fitting)]),
                                    timeout=TIMEOUT_S)
        except GRPCError as exc:
            status = exc.status.name
        results[kind].append((status, (time.perf_counter() - start) * 1e3))

    async def flooder(index: int) -> None:
        stub = EngineServiceStub(channels[index])
        i = index
        while time.perf_counter() < deadline:
            await one(("generate", "tokenize", "tokenize_fit")[i % 3], stub, i)
            i += 1

    try:
        await asyncio.gather(*(flooder(i) for i in range(flooders)))
    finally:
        for channel in channels:
            channel.close()
    return results


# --- the driver -----------------------------------------------------------------------------------


class Server:
    def __init__(self, label: str, root: Path, workdir: Path, *, nice: int) -> None:
        self.label = label
        self.ready = workdir / f"{label}.ready"
        self.log = (workdir / f"{label}.log").open("wb")
        env = dict(os.environ)
        # NOTE: another tree's server (a worktree of an older commit) runs its own sources
        env["PYTHONPATH"] = os.pathsep.join([str(root / "server"), str(root / "gen" / "python")])
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine_server", "--port", "0", "--ready-file", str(self.ready),
             "--log-level", "warning", "--max-num-seqs", "64"],
            cwd=root, env=env, stdout=self.log, stderr=self.log, preexec_fn=_pinned(FRONTEND_CORE, nice=nice),
        )
        deadline = time.monotonic() + 300
        while not self.ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{label} server did not start: see {self.log.name}")
            time.sleep(0.1)
        self.port = int(json.loads(self.ready.read_text())["port"])
        # NOTE: the frontend's core is its own: the engine core process moves to the clients' core (it is
        # mostly idle: one 4-token request at a time)
        for pid in descendants(self.process.pid):
            if pid != self.process.pid and process_name(pid) == ENGINE_CORE:
                os.sched_setaffinity(pid, {CLIENT_CORE})

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.log.close()


def _pinned(core: int, *, nice: int = 0) -> Any:
    def preexec() -> None:
        os.sched_setaffinity(0, {core})
        os.nice(nice)

    return preexec


def _client(*args: str, nice: int = 0) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE,
                            preexec_fn=_pinned(CLIENT_CORE, nice=nice))


def _result(process: subprocess.Popen[bytes]) -> dict[str, Any]:
    out, _ = process.communicate(timeout=600)
    if process.returncode != 0:
        raise RuntimeError(f"client failed ({process.returncode})")
    result: dict[str, Any] = json.loads(out)
    return result


def run_server(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    port = str(server.port)
    nice = args.nice
    warm = _client("probe", port, "2", nice=nice)  # first calls, lazy imports: not measured
    _result(warm)
    rss = {"warm": _rss_mib(server.process.pid)}
    waited = CpuWait(server.process.pid)
    quiet = _result(_client("probe", port, str(args.seconds), nice=nice))
    quiet["cpu_wait"] = waited.percent()
    rss["quiet"] = _rss_mib(server.process.pid)
    flooded: dict[str, list[Any]] = {"getload_ms": [], "ttft_ms": [], "errors": []}
    calls: dict[str, list[Any]] = {"generate": [], "tokenize": [], "tokenize_fit": []}
    rss["peak"] = rss["quiet"]
    for round_index in range(args.floods):
        # NOTE: the flooder yields its core to the prober (10 nice levels lower) and takes all the rest
        waited = CpuWait(server.process.pid)
        flood = _client("flood", port, str(args.seconds + 1), str(args.flooders), str(args.text_mb),
                        str(args.fit_chars), nice=min(19, nice + 10))
        time.sleep(1.0)  # the flood is under way (its texts are built) before the prober starts
        probe = _client("probe", port, str(args.seconds - 1), nice=nice)
        while probe.poll() is None or flood.poll() is None:
            rss["peak"] = max(rss["peak"], _rss_mib(server.process.pid))
            time.sleep(0.2)
        for key, values in _result(probe).items():
            flooded[key] += values
        flooded.setdefault("cpu_wait", []).append(waited.percent())
        for kind, kind_calls in _result(flood).items():
            calls[kind] += kind_calls
        time.sleep(args.settle)  # idle, then the memory the flood left behind
        rss[f"after {round_index + 1}"] = _rss_mib(server.process.pid)
    after = _result(_client("probe", port, "3", nice=nice))  # the server still serves, and as fast
    return {"label": server.label, "quiet": quiet, "flooded": flooded, "flood": calls, "after": after,
            "rss_mib": rss}


def _row(result: dict[str, Any]) -> list[str]:
    quiet, flooded = result["quiet"], result["flooded"]
    q_ttft, f_ttft = _pct(quiet["ttft_ms"], 0.99), _pct(flooded["ttft_ms"], 0.99)
    rss = result["rss_mib"]
    return [
        result["label"],
        f"{_pct(quiet['getload_ms'], 0.5):.1f} / {_pct(quiet['getload_ms'], 0.99):.1f}",
        f"{_pct(flooded['getload_ms'], 0.5):.1f} / {_pct(flooded['getload_ms'], 0.99):.1f} / "
        f"{max(flooded['getload_ms'], default=float('nan')):.0f}",
        f"{_pct(quiet['ttft_ms'], 0.5):.1f} / {q_ttft:.1f}",
        f"{_pct(flooded['ttft_ms'], 0.5):.1f} / {f_ttft:.1f} ({f_ttft / q_ttft:.2f}x)",
        f"{len(quiet['getload_ms'])} / {len(flooded['getload_ms'])}",
        " / ".join(f"{mib:.0f}" for mib in rss.values()),
        " / ".join(f"{pct:.1f}" for pct in [quiet["cpu_wait"], *flooded["cpu_wait"]]),
    ]


def _flood_row(result: dict[str, Any], kind: str) -> str:
    calls = result["flood"][kind]
    statuses: dict[str, int] = {}
    for status, _ in calls:
        statuses[status] = statuses.get(status, 0) + 1
    times = [ms for _, ms in calls]
    counts = ", ".join(f"{count} {status}" for status, count in sorted(statuses.items()))
    return f"{counts or 'none'}; p50 {_pct(times, 0.5):.0f} ms, max {max(times, default=float('nan')):.0f} ms"


def render(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = ["server", "GetLoad quiet p50 / p99 ms", "GetLoad flooded p50 / p99 / max ms",
              "TTFT quiet p50 / p99 ms", "TTFT flooded p50 / p99 ms (vs quiet)", "GetLoads quiet / flooded",
              "frontend RSS MiB: " + " / ".join(results[0]["rss_mib"]),
              "frontend waiting for its core, %: quiet / each flood"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_row(result)) + " |" for result in results]
    flood_lines = ["| server | Generate text | Tokenize text | Tokenize text that fits |",
                   "|---|---|---|---|"]
    flood_lines += [f"| {r['label']} | {_flood_row(r, 'generate')} | {_flood_row(r, 'tokenize')} | "
                    f"{_flood_row(r, 'tokenize_fit')} |" for r in results]
    return "\n\n".join([
        f"{SECTION}; {now}, {_cpu_name()}, {os.cpu_count()} vCPUs)",
        f"Load average {args.load_before:.1f} / {os.getloadavg()[0]:.1f} at the start / end (a shared "
        "machine: other sessions' benchmarks ran meanwhile). Command: "
        f"`.venv/bin/python bench/tokenize_flood.py {' '.join(sys.argv[1:])}`. Tiny model (context 2048 "
        "tokens, longest token 13 bytes: texts over 26,624 bytes cannot fit). The frontend alone on core "
        f"{FRONTEND_CORE}; the engine core process, the prober and the flooder on core {CLIENT_CORE}; server "
        f"and prober at nice {args.nice}, the flooder at nice {min(19, args.nice + 10)} (it takes what the "
        "prober leaves). Per server: the prober alone for "
        f"{args.seconds:g} s (quiet), then {args.floods} floods of {args.seconds:g} s, each while "
        f"{args.flooders} flooder stream(s) send back to back, in turn, Generate(text) and Tokenize(text) of "
        f"{args.text_mb:g} MB each and Tokenize of a {args.fit_chars}-character text (under the bound: "
        "tokenized, on the pool where there is one). Prober: GetLoad back to back (5 ms apart) on one "
        "connection, and streamed token-id Generates (10-token prompt, 4 tokens) one after another on "
        "another; TTFT = send to the first token. Frontend RSS: after warm-up, after the quiet phase, the "
        f"highest during the floods, and {args.settle:g} s after each flood. Waiting for its core: the share "
        "of each phase in which the frontend's loop thread was runnable but other processes had its core "
        "(/proc/PID/schedstat; the machine is shared).",
        "\n".join(lines),
        "What the flooder's calls got (status counts; time per call):",
        "\n".join(flood_lines),
    ])


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_section(path: Path, section: str) -> None:
    """Under "## Reliability" (created at the end if missing): this subsection replaced or appended."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    if "\n## Reliability\n" not in text:
        text = text.rstrip("\n") + "\n\n## Reliability\n"
    head, rest = text.split("\n## Reliability\n", 1)
    next_top = rest.find("\n## ")
    body, tail = (rest, "") if next_top < 0 else (rest[:next_top], rest[next_top:])
    start = body.find(SECTION)
    if start >= 0:
        end = body.find("\n### ", start + len(SECTION))
        body = body[:start] + (body[end + 1:] if end >= 0 else "")
    body = body.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(head + "\n## Reliability\n" + body + tail, encoding="utf-8")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("probe", "flood"):
        import uvloop

        if sys.argv[1] == "probe":
            result = uvloop.run(_probe(int(sys.argv[2]), float(sys.argv[3])))
        else:
            result = uvloop.run(_flood(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]),
                                       float(sys.argv[5]), int(sys.argv[6])))
        json.dump(result, sys.stdout)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=15.0, help="quiet and flooded phases, each")
    p.add_argument("--flooders", type=int, default=1, help="concurrent flooding streams")
    p.add_argument("--text-mb", type=float, default=4.0, help="size of each flooded text, MB")
    p.add_argument("--fit-chars", type=int, default=20_000, help="the flooded text that fits, characters")
    p.add_argument("--floods", type=int, default=2, help="flood phases per server (memory after each)")
    p.add_argument("--nice", type=int, default=0,
                   help="the server's and the prober's nice value (the flooder's is 10 more): e.g. -10 on a "
                        "machine shared with other work, so that it does not preempt what is measured")
    p.add_argument("--settle", type=float, default=12.0, help="idle seconds before RSS is read after")
    p.add_argument("--baseline", default=None, help="also a server from this tree (an older commit)")
    p.add_argument("--markdown", default=None, help="write the section into this file")
    p.add_argument("--json", default=None, help="write the raw results here")
    args = p.parse_args()
    args.load_before = os.getloadavg()[0]
    trees = [("this tree", ROOT)]
    if args.baseline:
        trees.insert(0, (f"before ({_commit(Path(args.baseline))})", Path(args.baseline)))
    results = []
    with tempfile.TemporaryDirectory(prefix="tokenize-flood-") as tmp:
        for label, root in trees:
            print(f"== {label}", flush=True)
            server = Server(label.split()[0], root, Path(tmp), nice=args.nice)
            try:
                result = run_server(server, args)
            except Exception:
                print(Path(server.log.name).read_text(errors="replace")[-3000:], file=sys.stderr)
                raise
            finally:
                server.stop()
            result["label"] = label
            results.append(result)
            print("\n".join(f"   {cell}" for cell in _row(result)), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    section = render(results, args)
    if args.markdown:
        write_section(Path(args.markdown), section)
    print(section)


def _commit(root: Path) -> str:
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() or str(root)


if __name__ == "__main__":
    main()
