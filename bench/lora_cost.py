#!/usr/bin/env python3
"""What serving LoRA adapters costs the engine (issue 41); not a test.

One LLMEngine in this process (the 30M benchmark Llama by default, float32, one torch thread) with 8 random
rank-16 adapters on every projection (built with peft, a dev dependency), loaded at start:

1. decode step: 64 sequences spread over the 8 adapters vs the same 64 on the base model (target <= 1.3x);
   the sequences are brought to decoding first (that prefill step is timed too), then `--steps` decode steps
   are timed, the modes alternating over `--rounds` rounds (median of each round's per-step median);
2. throughput: the 8 adapters served together (64 sequences in one batch) vs one adapter at a time with its
   weights merged (8 sequences a batch, at the base model's step time: a merged model costs what the base
   does; merging itself not counted, which favours that side) (target >= 3x);
3. adapter load time (LoadAdapter's work: read, check, convert), median of 5.

Times are the thread's CPU time (the step's work is all on this thread), so other processes on a shared
machine distort them less than wall time would.

Usage: lora_cost.py [--model DIR] [--seqs 64] [--adapters 8] [--rank 16] [--steps 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the adapter builder (peft)

import torch
from engine_server.engine.config import EngineConfig
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, SamplingParams
from engine_server.models.tiny import BENCH_30M, cached_model_dir
from lora_testutil import ATTENTION, MLP, AdapterSpec, build_adapter

PROMPT_LEN = 32


def step_times(engine: LLMEngine, adapters: list[str], *, tag: str, steps: int) -> tuple[float, list[float]]:
    """CPU seconds of the prefill step (every prompt at once) and of each of `steps` decode steps of
    len(adapters) sequences (adapter i for sequence i)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    spread = min(8000, engine.model_info.vocab_size - 16)
    for i, adapter in enumerate(adapters):
        prompt = tuple(16 + (i * 7919 + k * 131) % spread for k in range(PROMPT_LEN))
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params, adapter=adapter))
    start = time.thread_time()
    engine.step()  # every prefill (64 x 32 tokens fits the step's budget)
    prefill = time.thread_time() - start
    times = []
    for _ in range(steps):
        start = time.thread_time()
        engine.step()
        times.append(time.thread_time() - start)
    engine.abort([f"{tag}-{i}" for i in range(len(adapters))])
    while engine.has_unfinished():
        engine.step()
    return prefill, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = Path(args.model) if args.model else cached_model_dir(BENCH_30M.name)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        names = [f"a{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            spec = AdapterSpec(name, args.rank, ATTENTION + MLP, lora_alpha=32, seed=i)
            build_adapter(model_dir, root, spec)
        config = EngineConfig(model=str(model_dir), max_num_seqs=args.seqs, max_num_batched_tokens=4096,
                              num_kv_blocks=args.seqs * 4 + 16, max_adapters=args.adapters,
                              max_lora_rank=args.rank, adapters=tuple((n, str(root / n)) for n in names),
                              adapter_dir=str(root),
                              enable_prefix_caching=False)  # every round's prefill computes its prompts
        engine = LLMEngine(config)
        spread = [names[i % len(names)] for i in range(args.seqs)]
        per_adapter = args.seqs // len(names)
        base, lora, small, base_prefill, lora_prefill = [], [], [], [], []
        for r in range(args.rounds):
            prefill, times = step_times(engine, [""] * args.seqs, tag=f"b{r}", steps=args.steps)
            base.append(statistics.median(times))
            base_prefill.append(prefill)
            prefill, times = step_times(engine, spread, tag=f"l{r}", steps=args.steps)
            lora.append(statistics.median(times))
            lora_prefill.append(prefill)
            small.append(statistics.median(step_times(engine, [""] * per_adapter, tag=f"s{r}",
                                                      steps=args.steps)[1]))
        loads = []
        for i in range(5):
            start = time.perf_counter()
            engine.load_adapter(f"timed{i}", names[0])
            loads.append(time.perf_counter() - start)
            engine.unload_adapter(f"timed{i}")
    t_base, t_lora, t_small = (statistics.median(x) for x in (base, lora, small))
    together = args.seqs / t_lora  # tokens per CPU-second, all adapters in one batch
    one_at_a_time = per_adapter / t_small  # one merged adapter's 8 sequences per batch
    print(f"model {model_dir.name}, {args.seqs} sequences, {args.adapters} adapters of rank {args.rank} "
          f"(all 7 projections), float32, 1 thread; medians of {args.rounds} rounds x {args.steps} steps")
    print(f"decode step, base:              {t_base * 1e3:7.2f} ms   (rounds: "
          f"{', '.join(f'{x * 1e3:.2f}' for x in base)})")
    print(f"decode step, {args.adapters} adapters:        {t_lora * 1e3:7.2f} ms   (rounds: "
          f"{', '.join(f'{x * 1e3:.2f}' for x in lora)})")
    print(f"  ratio: {t_lora / t_base:.2f}x (target <= 1.3x)")
    p_base, p_lora = statistics.median(base_prefill), statistics.median(lora_prefill)
    print(f"prefill step ({args.seqs} x {PROMPT_LEN} tokens): base {p_base * 1e3:.1f} ms, "
          f"{args.adapters} adapters "
          f"{p_lora * 1e3:.1f} ms: {p_lora / p_base:.2f}x")
    print(f"decode step, base, {per_adapter} seqs:     {t_small * 1e3:7.2f} ms")
    print(f"throughput together: {together:8.0f} tok/CPU-s; one merged adapter at a time: "
          f"{one_at_a_time:8.0f} tok/CPU-s; ratio {together / one_at_a_time:.2f}x (target >= 3x)")
    print(f"adapter load (rank {args.rank}, every projection of every layer): "
          f"median {statistics.median(loads) * 1e3:.1f} ms of 5")


if __name__ == "__main__":
    main()
