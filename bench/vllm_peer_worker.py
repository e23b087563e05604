#!/usr/bin/env python3
"""One engine for bench/vllm_peer.py, in its own process (not a test): ours (`LLMEngine`, the project's .venv)
or vLLM's CPU engine (`vllm.LLM`, in-process, in its own virtualenv: the two need different torch builds).

It loads the model once, then answers commands, one JSON object a line on the file descriptor named by
--proto-fd (vLLM logs to stdout, so stdout goes to stderr here):
- {"cmd": "run", "requests": [[prompt_ids, max_tokens, arrival_s], ...], "tag": str}: runs them, requests
  arriving at their times (the arrival loop is the same for both engines: add what has arrived, step);
  replies tokens, wall time, TTFT and inter-token latency percentiles;
- {"cmd": "tokens", ...}: the same, replying each request's generated token ids (the equality check);
- {"cmd": "profile", "requests": ..., "skip": int, "steps": int}: torch.profiler over `steps` decode steps
  once every request has its first token (`skip` steps later), and over the prefill steps before; replies
  each op's self CPU time and the steps' wall time;
- {"cmd": "quit"}.
Greedy, ignore_eos, no detokenization on either side (our engine leaves it to the frontend).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent

Requests = list[tuple[list[int], int, float]]


class Engine(Protocol):
    """What the benchmark loop needs from either engine."""

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None: ...

    def step(self) -> list[tuple[str, int]]: ...  # (request_id, one new token id) per new token

    def has_unfinished(self) -> bool: ...


class OurEngine:
    def __init__(self, model: str, dtype: str, *, num_kv_blocks: int, threads: int) -> None:
        sys.path.insert(0, str(ROOT / "server"))
        from engine_server.engine.config import EngineConfig
        from engine_server.engine.llm_engine import LLMEngine
        from engine_server.engine.types import EngineRequest, SamplingParams

        self._request, self._params = EngineRequest, SamplingParams
        self.engine = LLMEngine(EngineConfig(
            model=model, dtype=dtype, num_kv_blocks=num_kv_blocks, max_num_seqs=256,
            max_num_batched_tokens=2048, num_threads=threads))

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(self._request(request_id, tuple(prompt), params))

    def step(self) -> list[tuple[str, int]]:
        return [(d.request_id, t) for d in self.engine.step() for t in d.new_token_ids]

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()


class VllmEngine:
    def __init__(self, model: str, dtype: str, *, kv_cache_bytes: int, mode: str) -> None:
        if "+zentorch" not in mode:
            # NOTE: vLLM picks its Zen platform (zentorch's linears) on AMD CPUs whenever zentorch imports
            sys.modules["zentorch"] = None  # type: ignore[assignment]
        from vllm import LLM
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._params, self._prompt, self._delta = VllmParams, TokensPrompt, RequestOutputKind.DELTA
        self.llm = LLM(model=model, dtype=dtype, max_num_seqs=256, max_num_batched_tokens=2048,
                       kv_cache_memory_bytes=kv_cache_bytes, enforce_eager=mode.startswith("eager"), seed=0,
                       disable_log_stats=True)
        self.engine = self.llm.llm_engine

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = self._params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                              output_kind=self._delta)
        self.engine.add_request(request_id, self._prompt(prompt_token_ids=prompt), params)

    def step(self) -> list[tuple[str, int]]:
        return [(out.request_id, t) for out in self.engine.step() for t in out.outputs[0].token_ids]

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished_requests())


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def drive(engine: Engine, requests: Requests, tag: str,
          on_step: Callable[[int, dict[str, list[float]]], None] | None = None
          ) -> tuple[float, dict[str, list[float]], dict[str, list[int]]]:
    """Runs the requests with their arrival times; returns the wall time, token timestamps and token ids."""
    ids = [f"{tag}-{i}" for i in range(len(requests))]
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    pending = list(zip(ids, requests, strict=True))
    num_steps = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][1][2] <= now:
            rid, (prompt, max_tokens, _) = pending.pop(0)
            engine.add(rid, prompt, max_tokens)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][1][2] - now))
            continue
        if on_step is not None:
            on_step(num_steps, stamps)
        new = engine.step()
        num_steps += 1
        t = time.perf_counter()
        for rid, token in new:
            stamps[rid].append(t)
            tokens[rid].append(token)
    return time.perf_counter() - t0, stamps, tokens


def run(engine: Engine, requests: Requests, tag: str) -> dict[str, Any]:
    t_start, cpu_start = time.perf_counter(), time.process_time()
    wall, stamps, _ = drive(engine, requests, tag)
    cpu = time.process_time() - cpu_start  # every thread of this process: the work, and any spinning
    ttft: list[float] = []
    itl: list[float] = []
    for i, (_, _, arrival) in enumerate(requests):
        times = stamps[f"{tag}-{i}"]
        if times:
            ttft.append(times[0] - (t_start + arrival))
            itl.extend(b - a for a, b in itertools.pairwise(times))
    num_tokens = sum(len(s) for s in stamps.values())
    return {"wall_s": wall, "num_tokens": num_tokens, "tok_s": num_tokens / wall, "cpu_s": cpu,
            "tok_cpu_s": num_tokens / cpu,
            "ttft_p50_ms": pct(ttft, .5) * 1e3, "ttft_p99_ms": pct(ttft, .99) * 1e3,
            "itl_p50_ms": pct(itl, .5) * 1e3, "itl_p99_ms": pct(itl, .99) * 1e3}


@contextlib.contextmanager
def _kernel_ranges() -> Iterator[None]:
    """Our C++ kernels are pybind functions, invisible to torch.profiler: each call gets a named range."""
    sys.path.insert(0, str(ROOT / "server"))
    import torch
    from engine_server.engine import cpu_kernels

    class Ranged:
        def __init__(self, module: Any) -> None:
            self._module = module

        def __getattr__(self, name: str) -> Any:
            fn = getattr(self._module, name)
            if not callable(fn) or name == "isa":
                return fn

            def call(*args: Any, **kwargs: Any) -> Any:
                with torch.profiler.record_function(f"engine_kernel::{name}"):
                    return fn(*args, **kwargs)
            return call

    original = cpu_kernels.load

    def load() -> Any:
        module = original()
        return None if module is None else Ranged(module)

    cpu_kernels.load = load
    try:
        yield
    finally:
        cpu_kernels.load = original


def profile(engine: Engine, requests: Requests, *, skip: int, steps: int) -> dict[str, Any]:
    """Op self times (CPU) over the prefill steps and over `steps` decode steps, and their wall times."""
    import torch
    from torch.profiler import ProfilerActivity

    windows: dict[str, dict[str, Any]] = {}
    state: dict[str, Any] = {"phase": "prefill", "prof": None, "t": 0.0, "n": 0, "decode_from": None}

    def close() -> None:
        prof = state["prof"]
        if prof is None:
            return
        prof.__exit__(None, None, None)
        wall = time.perf_counter() - state["t"]
        ops = {e.key: [e.self_cpu_time_total, e.count] for e in prof.key_averages()}
        windows[state["phase"]] = {"steps": state["n"], "wall_s": wall, "ops_us": ops}
        state["prof"] = None

    def open_window(phase: str) -> None:
        state.update(phase=phase, n=0, t=time.perf_counter())
        state["prof"] = torch.profiler.profile(activities=[ProfilerActivity.CPU])
        state["prof"].__enter__()
        state["t"] = time.perf_counter()

    def on_step(step: int, stamps: dict[str, list[float]]) -> None:
        if step == 0:
            open_window("prefill")
        elif state["phase"] == "prefill" and all(stamps.values()):
            close()
            state["decode_from"] = step + skip
            state["phase"] = "waiting"
        if state["phase"] == "waiting" and step == state["decode_from"]:
            open_window("decode")
        if state["phase"] == "decode" and state["n"] == steps:
            close()
            state["phase"] = "done"
        if state["prof"] is not None:
            state["n"] += 1

    drive(engine, requests, "profile", on_step)
    close()
    return windows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, choices=("ours", "vllm"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True, choices=("float32", "bfloat16"))
    parser.add_argument("--proto-fd", type=int, required=True)
    parser.add_argument("--num-kv-blocks", type=int, default=4096, help="ours: KV blocks of 16 tokens")
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="vllm: KV cache size")
    parser.add_argument("--threads", type=int, default=2, help="ours: torch threads")
    parser.add_argument("--vllm-mode", default="compiled", help="compiled|eager, +zentorch to let it load")
    parser.add_argument("--profile", action="store_true", help="ours: name the C++ kernels' calls")
    args = parser.parse_args()
    proto = os.fdopen(args.proto_fd, "w", buffering=1)
    os.dup2(2, 1)  # NOTE: vLLM's logger writes to stdout; the protocol has its own descriptor
    started = time.perf_counter()
    engine: Engine
    if args.engine == "ours":
        with _kernel_ranges() if args.profile else contextlib.nullcontext():
            engine = OurEngine(args.model, args.dtype, num_kv_blocks=args.num_kv_blocks, threads=args.threads)
    else:
        engine = VllmEngine(args.model, args.dtype, kv_cache_bytes=args.kv_cache_bytes, mode=args.vllm_mode)
    import torch

    info = {"ready": True, "load_s": time.perf_counter() - started, "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    if args.engine == "vllm":
        import vllm
        from vllm.platforms import current_platform

        info.update(vllm=vllm.__version__, platform=type(current_platform).__name__)
    proto.write(json.dumps(info) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        requests: Requests = [(list(p), int(m), float(a)) for p, m, a in cmd.get("requests", [])]
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "run":
            reply: dict[str, Any] = run(engine, requests, cmd["tag"])
        elif cmd["cmd"] == "tokens":
            _, _, tokens = drive(engine, requests, cmd["tag"])
            reply = {"tokens": [tokens[f"{cmd['tag']}-{i}"] for i in range(len(requests))]}
        elif cmd["cmd"] == "profile":
            reply = profile(engine, requests, skip=int(cmd["skip"]), steps=int(cmd["steps"]))
        else:
            reply = {"error": f"unknown command {cmd['cmd']!r}"}
        reply["loadavg"] = os.getloadavg()[0]
        proto.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
