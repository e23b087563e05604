"""glibc malloc settings of a CPU engine's process (engine/malloc_policy.py): freed memory stays mapped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from engine_server.engine import loader, malloc_policy
from engine_server.engine.config import EngineConfig

glibc_only = pytest.mark.skipif(not malloc_policy.runs_on_glibc(), reason="mallopt settings are glibc's")

# A step's worth of activations: ten 4 MiB tensors alive together, written, then all freed; the minor page
# faults of ten more steps after three to warm up. Under glibc's defaults the freed heap top is trimmed and
# faulted in again (~100 faults a step here); kept, a later step faults nothing.
_STEPS = textwrap.dedent("""
    import resource, torch
    from engine_server.engine import malloc_policy
    applied = malloc_policy.keep_freed_heap()
    def step():
        live = [torch.empty(1 << 20).fill_(1.0) for _ in range(10)]
        del live
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _run_steps(**env: str) -> tuple[str, int]:
    """Runs _STEPS in a fresh process (with `env` added): what keep_freed_heap() returned, the faults."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run([sys.executable, "-c", _STEPS], env=environment, capture_output=True,
                         text=True, check=True, timeout=120).stdout.split()
    return out[0], int(out[1])


@glibc_only
def test_freed_activations_are_not_faulted_in_again() -> None:
    applied, faults = _run_steps()
    assert applied == "True"
    assert faults <= 64, f"{faults} minor faults in 10 steps with the policy"


@glibc_only
def test_settings_the_user_made_stand() -> None:
    applied, faults = _run_steps(MALLOC_TOP_PAD_="0")
    assert applied == "False"
    # theirs, not the policy's, is in force (glibc 2.36: a set top pad fixes the mmap threshold at 128 KiB, so
    # every tensor is mapped anew, ~100,000 faults)
    assert faults > 64


def test_loading_a_model_on_cpu_applies_it(monkeypatch: pytest.MonkeyPatch, model_dir: Path) -> None:
    calls: list[str] = []

    def record() -> bool:
        calls.append("applied")
        return True

    monkeypatch.setattr(malloc_policy, "keep_freed_heap", record)
    loaded = loader.load_model(EngineConfig(model=str(model_dir), device="cpu"))
    assert loaded.device.type == "cpu"
    assert calls == ["applied"]
