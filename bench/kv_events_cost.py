#!/usr/bin/env python3
"""What publishing the prefix cache's events costs the engine step (issue 40: target < 2%); not a test.

One LLMEngine in this process runs the same waves of requests (prompts sharing 16 system prompts, a unique
tail each, a KV cache small enough to evict) alternately without a subscriber (nothing recorded: the
engine as it runs with nobody watching) and with one (the core's CachePublisher records, numbers and
pickles each step's batch, as the core loop does before its pipe write). The figure is the sum of step
times (step + publish + pickle) per mode, the median over alternating rounds. Times are the thread's CPU
time (one torch thread: the step's work is all on it), so other processes on a shared machine distort them
less than wall time would; the publishing share is timed on its own as well.

Usage: kv_events_cost.py [--model DIR] [--seqs 16] [--rounds 7] [--output 16] [--kv-blocks 600]
       (default model: the tiny test model, the cheapest step: the worst case for a fixed cost per step)
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

import torch
from engine_server.core.cache_messages import CacheEventBatch, CacheEventsStart
from engine_server.core.cache_publisher import CachePublisher
from engine_server.engine.config import EngineConfig
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, SamplingParams
from engine_server.models.tiny import default_model_dir

SYSTEM_LEN = 128  # tokens of each shared system prompt (8 blocks of 16)
TAIL_LEN = 40


def prompt(wave: int, i: int) -> tuple[int, ...]:
    system = [16 + (i % 16 * 7919 + k * 131) % 1000 for k in range(SYSTEM_LEN)]
    tail = [16 + (wave * 104729 + i * 7907 + k * 17) % 1000 for k in range(TAIL_LEN)]
    return (*system, *tail)


def run_wave(engine: LLMEngine, publisher: CachePublisher | None, wave: int, num_seqs: int,
             output: int) -> tuple[float, float, int]:
    """(seconds spent stepping and publishing, of which publishing, steps) for one wave of requests."""
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(EngineRequest(f"w{wave}-{i}", prompt(wave, i), params))
    elapsed, publishing, steps = 0.0, 0.0, 0
    while engine.has_unfinished():
        start = time.thread_time()
        engine.step()
        if publisher is not None:
            stepped = time.thread_time()
            publisher.publish()
            publishing += time.thread_time() - stepped
        elapsed += time.thread_time() - start
        steps += 1
    return elapsed, publishing, steps


def block_manager_alone(num_blocks: int, num_seqs: int, *, recording: bool, waves: int = 40) -> float:
    """CPU seconds of the block manager's own work for `waves` waves of the benchmark's prompts (admit with
    the prefix cache, compute block by block as decode does, free), recording or not, events taken each
    "step": the part of the recording cost that runs inside engine.step()."""
    from engine_server.engine.block_manager import BlockManager
    from engine_server.engine.sequence import Sequence

    bm = BlockManager(num_blocks, 16, enable_prefix_caching=True)
    if recording:
        bm.cache_events.start()
    start = time.thread_time()
    for wave in range(waves):
        seqs = []
        for i in range(num_seqs):
            seq = Sequence(seq_id=i, request_id=str(i), index=0, params=SamplingParams(),
                           token_ids=list(prompt(wave, i)), num_prompt_tokens=SYSTEM_LEN + TAIL_LEN,
                           max_tokens=16)
            cached, hashes = bm.match_prefix(seq)
            if not bm.can_admit(cached, seq.num_tokens + 16):
                break
            bm.admit(seq, cached, hashes)
            bm.ensure_blocks(seq, seq.num_tokens)
            seq.num_computed_tokens = seq.num_tokens
            bm.register_full_blocks(seq)
            seqs.append(seq)
        bm.cache_events.take()
        for token in range(16):  # decode: one token a step per sequence
            for seq in seqs:
                seq.token_ids.append(token)
                bm.ensure_blocks(seq, seq.num_tokens)
                seq.num_computed_tokens = seq.num_tokens
                bm.register_full_blocks(seq)
            bm.cache_events.take()
        for seq in seqs:
            bm.free(seq)
    return time.thread_time() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--waves", type=int, default=4, help="waves per mode per round")
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-memory", type=int, default=6 * 2**20, help="bytes (small: evictions happen)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or str(default_model_dir())
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=args.seqs,
                                    kv_cache_memory_bytes=args.kv_cache_memory))
    counts = {"batches": 0, "events": 0, "removed": 0, "bytes": 0}

    def send(_index: int, message: CacheEventBatch | CacheEventsStart) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # the pipe write's serialization
        if isinstance(message, CacheEventBatch):
            counts["batches"] += 1
            counts["events"] += len(message.events)
            counts["removed"] += sum(1 for e in message.events if type(e).__name__ == "BlocksRemoved")
            counts["bytes"] += len(data)

    publisher = CachePublisher(engine.block_manager, send)
    info = engine.model_info
    wave = 0
    run_wave(engine, None, wave, args.seqs, args.output)  # warm-up
    per_step: dict[str, list[float]] = {"off": [], "on": []}
    total_steps = {"off": 0, "on": 0}
    publish_ms: list[float] = []
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            if mode == "on":
                publisher.set_subscribed(0, True)  # (its snapshot is not timed: once per subscription)
            elapsed, publishing, steps = 0.0, 0.0, 0
            for _ in range(args.waves):
                wave += 1
                seconds, publish_s, num_steps = run_wave(engine, publisher if mode == "on" else None, wave,
                                                         args.seqs, args.output)
                elapsed += seconds
                publishing += publish_s
                steps += num_steps
            if mode == "on":
                publish_ms.append(publishing / steps * 1e3)
            publisher.set_subscribed(0, False)
            per_step[mode].append(elapsed / steps * 1e3)
            total_steps[mode] += steps
    off, on = statistics.median(per_step["off"]), statistics.median(per_step["on"])
    print(f"model {Path(info.model_path).name}: {info.num_kv_blocks} KV blocks of {info.block_size}, "
          f"{args.seqs} requests a wave ({SYSTEM_LEN}-token shared system prompt + {TAIL_LEN}-token tail, "
          f"{args.output} tokens out), {args.rounds} rounds x {args.waves} waves a mode")
    print(f"step time, median of rounds: without a subscriber {off:.3f} ms, with one {on:.3f} ms: "
          f"{(on / off - 1) * 100:+.2f}%")
    publish = statistics.median(publish_ms)
    print(f"of which publishing (take, number, pickle): {publish * 1e3:.1f} us a step, "
          f"{publish / off * 100:.2f}% of the step without a subscriber")
    # the recording inside the step, on the block manager alone (min of 5: the least disturbed run)
    steps_alone = args.waves * 10 * (16 + 1)
    alone = {mode: min(block_manager_alone(info.num_kv_blocks, args.seqs, recording=mode == "on",
                                           waves=args.waves * 10) for _ in range(5))
             for mode in ("off", "on")}
    recording_us = (alone["on"] - alone["off"]) / steps_alone * 1e6
    print(f"of which recording in the block manager: {recording_us:.1f} us a step "
          f"({alone['off'] / steps_alone * 1e6:.1f} -> {alone['on'] / steps_alone * 1e6:.1f} us of its own "
          f"work), "
          f"{recording_us / 1e3 / off * 100:.2f}% of the step; with publishing: "
          f"{(recording_us / 1e3 + publish) / off * 100:.2f}%")
    print(f"  rounds off: {' '.join(f'{x:.3f}' for x in per_step['off'])}")
    print(f"  rounds on:  {' '.join(f'{x:.3f}' for x in per_step['on'])}")
    print(f"published: {counts['batches']} batches over {total_steps['on']} steps, {counts['events']} events "
          f"({counts['removed']} of them evictions), "
          f"{counts['bytes'] / max(counts['batches'], 1):.0f} bytes a batch pickled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
