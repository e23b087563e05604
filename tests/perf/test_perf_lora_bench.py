"""bench/lora_cost.py's machinery on the tiny model: it runs, and reports each figure (not its numbers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine_server.models.tiny import default_model_dir

BENCH = Path(__file__).resolve().parents[2] / "bench" / "lora_cost.py"


def test_lora_bench_reports_every_figure() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--model", str(default_model_dir()), "--seqs", "8", "--adapters", "2",
         "--rank", "4", "--steps", "2", "--rounds", "1"],
        capture_output=True, text=True, timeout=240, check=True).stdout
    for figure in ("decode step, base:", "decode step, 2 adapters:", "ratio:", "throughput together:",
                   "adapter load (rank 4"):
        assert figure in out, out
