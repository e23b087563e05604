"""The command line: help, usage errors as one line with exit code 2, and no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from engine_server.cli import build_configs, build_parser, parse_size


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine_server", *args], capture_output=True, text=True, timeout=120
    )


def test_help_exits_zero_and_lists_the_flags() -> None:
    result = _cli("--help")
    assert result.returncode == 0
    for flag in (
        "--model",
        "--port",
        "--ready-file",
        "--api-key",
        "--tls-cert",
        "--drain-timeout",
        "--metrics-port",
        "--no-reflection",
        "--max-concurrent-streams",
        "--kv-cache-memory",
    ):
        assert flag in result.stdout
    # What the key guards, as api/security/config.py's AUTH_EXEMPT_SERVICES has it (and docs/deploy.md)
    assert "every call but health and reflection" in " ".join(result.stdout.split())


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--bogus",), "unrecognized arguments: --bogus"),
        (("--model", "/does/not/exist"), "--model: no such directory: /does/not/exist"),
        (("--port", "seventy"), "--port: invalid int value"),
        (("--kv-cache-memory", "lots"), "not a size"),
        (("--tls-cert", "/nope.pem", "--tls-key", "/nope.key"), "no such file"),
        (("--api-key", "a", "--api-key-file", "/x"), "not both"),
        (("--num-threads", "0"), "--num-threads: must be >= 1"),
    ],
)
def test_usage_errors_are_one_line_and_exit_two(args: tuple[str, ...], fragment: str) -> None:
    result = _cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("engine-server: error: ")
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr


def test_parse_size() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("256MiB") == 256 * 2**20
    assert parse_size("1GiB") == 2**30
    assert parse_size("2M") == 2_000_000


def test_flags_reach_the_configs(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = build_parser().parse_args(
        [
            "--model",
            str(tmp_path),
            "--port",
            "0",
            "--max-num-seqs",
            "8",
            "--num-kv-blocks",
            "64",
            "--no-reflection",
            "--drain-timeout",
            "2.5",
            "--max-receive-message-size",
            "1MiB",
            "--api-key",
            "k3y",
            "--num-threads",
            "1",
        ]
    )
    server, engine = build_configs(args)
    assert (server.port, server.enable_reflection, server.drain_timeout_s) == (0, False, 2.5)
    assert server.security.max_receive_message_size == 2**20
    assert server.security.api_key == "k3y"
    assert (engine.model, engine.max_num_seqs, engine.num_kv_blocks) == (str(tmp_path), 8, 64)
    assert engine.num_threads == 1
