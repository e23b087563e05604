#!/usr/bin/env python3
"""Builds the random-weight test models (deterministic, seconds): OUT_DIR/<name> for each spec.

Usage: build_test_models.py OUT_DIR [--only tiny-llama|bench-llama-30m|bench-llama-1b] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from engine_server.models.tiny import BENCH_1B, SPECS, build_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--only", choices=sorted(SPECS), action="append")
    parser.add_argument("--device", default="cpu", help="where the random weights are drawn (cpu, cuda)")
    args = parser.parse_args()
    # The 1B benchmark model (2.5 GB) only when named.
    for name in args.only or sorted(set(SPECS) - {BENCH_1B.name}):
        target = args.out_dir / name
        build_model(SPECS[name], target, device=args.device)
        print(f"built {name} -> {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
