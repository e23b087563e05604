"""engine-server's LoRA adapter flags (adapter_flags.py): what they configure and what they refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_server.cli import UsageError, build_configs, build_parser


@pytest.fixture(autouse=True)
def _model_dir(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # what --model's check looks for


def test_adapters_are_off_unless_asked_for(tmp_path: Path) -> None:
    server, engine = build_configs(build_parser().parse_args(["--model", str(tmp_path)]))
    assert (engine.max_adapters, engine.adapters, engine.adapter_dir) == (0, (), None)
    assert not server.adapter_admin.enabled
    server, engine = build_configs(build_parser().parse_args(
        ["--model", str(tmp_path), "--adapter", "x=/p/x", "--adapter", "y=/p/y",
         "--adapter-dir", str(tmp_path), "--enable-adapter-admin", "--max-lora-rank", "64"]))
    assert engine.adapters == (("x", "/p/x"), ("y", "/p/y"))
    assert (engine.max_adapters, engine.max_lora_rank) == (4, 64)
    assert engine.adapter_dir == str(tmp_path.resolve())
    assert server.adapter_admin.enabled
    assert server.adapter_admin.admin_key is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--adapter", "no-path"], "NAME=PATH"),
    (["--adapter", "x=/a", "--adapter", "x=/b"], "twice"),
    (["--adapter-dir", "/nonexistent-dir"], "not a directory"),
    (["--enable-adapter-admin", "--api-key", "k1"], "admin key"),
    (["--admin-key", "k2"], "adapter management is off"),
    (["--adapter", "x=/a", "--max-adapters", "0"], "max_adapters >= 1"),
])
def test_bad_flags_are_usage_errors(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        build_configs(build_parser().parse_args(["--model", str(tmp_path), *argv]))
