"""The contract's guard rails: lint, formatting and the breaking-change check against the released image."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / ".venv" / "bin" / "buf"
RELEASES = ROOT / "proto" / "releases"


def latest_release() -> Path:
    """The newest released contract image (proto/releases/vX.Y.Z.binpb), by semantic version."""

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(part) for part in path.stem.lstrip("v").split("."))

    images = sorted(RELEASES.glob("v*.binpb"), key=version)
    assert images, "no released contract image in proto/releases"
    return images[-1]


def run_buf(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def contract_copy(tmp_path: Path) -> Path:
    """A scratch copy of the module (buf.yaml + proto/) to edit."""
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "proto", tmp_path / "proto", ignore=shutil.ignore_patterns("releases"))
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not found in {path}"
    path.write_text(text.replace(old, new, 1))


def test_lint_and_format_pass() -> None:
    lint = run_buf("lint", cwd=ROOT)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = run_buf("format", "--diff", "--exit-code", cwd=ROOT)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_current_contract_is_compatible_with_release() -> None:
    result = run_buf("breaking", "--against", str(latest_release()), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_additive_change_is_accepted(contract_copy: Path) -> None:
    edit(
        contract_copy / "proto/engine/v1/generate.proto",
        "  uint32 cached_prompt_tokens = 3;\n",
        "  uint32 cached_prompt_tokens = 3;\n"
        "  // A new field, added compatibly.\n"
        "  uint32 new_counter = 4;\n",
    )
    result = run_buf("breaking", "--against", str(latest_release()), cwd=contract_copy)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # A field's type changes: old clients would misparse it.
        ("  uint32 index = 1;\n  // The newly", "  string index = 1;\n  // The newly", r"changed type"),
        # A field's number changes: the wire tag of old clients no longer matches.
        ("  string request_id = 1;\n\n  // The prompt", "  string request_id = 15;\n\n  // The prompt",
         r"(deleted|changed)"),
    ],
    ids=["field-type", "field-number"],
)
def test_incompatible_change_fails_the_check(contract_copy: Path, old: str, new: str, expected: str) -> None:
    edit(contract_copy / "proto/engine/v1/generate.proto", old, new)
    assert run_buf("build", cwd=contract_copy).returncode == 0  # the edit itself is valid protobuf
    result = run_buf("breaking", "--against", str(latest_release()), cwd=contract_copy)
    assert result.returncode != 0, "buf breaking accepted an incompatible change"
    assert re.search(expected, result.stdout + result.stderr), result.stdout + result.stderr
