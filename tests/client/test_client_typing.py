"""mypy --strict passes on a program that uses the client, with no Any leaking out of the client's API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def test_typed_usage_passes_mypy_strict() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--disallow-any-expr",
         "--config-file", str(ROOT / "pyproject.toml"), str(HERE / "typed_usage.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
