"""The frontend benchmark's statistics (bench/frontend_lib): TTFT split into the first wave and the requests
after it, and the report table built from it."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from frontend_lib import report
from frontend_lib.workload import RequestTrace, summarize


def _trace(sent: float, ttft_ms: float, tokens: int = 3) -> RequestTrace:
    """A request whose first message arrives `ttft_ms` after `sent`, then one token per ms."""
    first = sent + ttft_ms / 1e3
    return RequestTrace(sent, [(first + k / 1e3, 1) for k in range(tokens)])


def test_first_wave_is_the_first_concurrency_requests_in_send_order() -> None:
    # 2 streams: the first wave waits 400 and 300 ms, the four requests after it 10-40 ms
    traces = [_trace(0.0, 400.0), _trace(0.0, 300.0)] + [_trace(1.0 + i, 10.0 * (i + 1)) for i in range(4)]
    s = summarize(traces, wall_s=10.0, client_cpu_s=1.0, concurrency=2)
    assert s.num_requests == 6
    assert s.num_tokens == 18
    assert math.isclose(s.ttft_first_wave_max_ms, 400.0, rel_tol=1e-6)
    assert math.isclose(s.ttft_after_first_wave_p99_ms, 10.0 * (1 + 0.99 * 3), rel_tol=1e-6)
    assert math.isclose(s.ttft_after_first_wave_std_ms, math.sqrt(125.0), rel_tol=1e-6)  # pstdev of 10..40
    # the whole-run statistics still cover every request
    assert s.ttft_p99_ms > 390.0
    assert s.ttft_std_ms > s.ttft_after_first_wave_std_ms


def test_one_wave_has_nothing_after_it() -> None:
    s = summarize([_trace(0.0, 5.0), _trace(0.0, 7.0)], wall_s=1.0, client_cpu_s=0.1, concurrency=2)
    assert math.isclose(s.ttft_first_wave_max_ms, 7.0, rel_tol=1e-6)
    assert math.isnan(s.ttft_after_first_wave_p99_ms)
    assert math.isnan(s.ttft_after_first_wave_std_ms)


def _row(server: str, first_max: float, p99: float, std: float) -> report.Row:
    return {"engine": "tiny", "server": server, "concurrency": 256, "ttft_first_wave_max_ms": first_max,
            "ttft_after_first_wave_p99_ms": p99, "ttft_after_first_wave_std_ms": std}


def test_first_wave_table_gives_ratios_to_the_sse_server() -> None:
    rows = [_row("grpc", 480.0, 110.0, 18.0), _row("sse", 640.0, 220.0, 36.0),
            _row("inproc", 400.0, math.nan, math.nan), _row("grpc", 1.0, 1.0, 1.0) | {"concurrency": 16}]
    lines = report.first_wave(rows, concurrency=256, step_ms=1.0).splitlines()
    assert len(lines) == 2 + 3  # header, rule, one line per server at 256 streams
    cells = {line.split(" | ")[1]: line.strip("| ").split(" | ")[2:] for line in lines[2:]}
    assert cells["engine-server (gRPC)"] == ["480", "0.75", "110", "0.50", "18", "0.50"]
    assert cells["HTTP/SSE reference"] == ["640", "1.00", "220", "1.00", "36", "1.00"]
    assert cells["in-process"] == ["400", "0.62", "-", "-", "-", "-"]


def _target_row(server: str, rounds: list[tuple[float, float, float]]) -> dict[str, object]:
    """A best row (its first round's numbers) with every round's (tokens/s, TTFT p99, TTFT stddev)."""
    keys = ("tokens_per_s", "ttft_p99_ms", "ttft_std_ms")
    every = [dict(zip(keys, r, strict=True)) for r in rounds]
    return {"engine": "tiny", "server": server, "concurrency": 256, **every[0], "rounds": every}


def test_targets_table_counts_the_rounds_each_target_held_in() -> None:
    rows = [
        # round 1: every target held; round 2: p99 0.8x and stddev 0.9x of the SSE server's; round 3: the
        # SSE server slower (tokens/s 1.5x) with a better p99 (0.5x) but a worse stddev (1.0x)
        _target_row("grpc", [(150.0, 70.0, 60.0), (150.0, 80.0, 90.0), (150.0, 50.0, 100.0)]),
        _target_row("sse", [(100.0, 100.0, 100.0), (100.0, 100.0, 100.0), (100.0, 100.0, 100.0)]),
        _target_row("inproc", [(160.0, 60.0, 50.0), (140.0, 60.0, 50.0), (170.0, 60.0, 50.0)]),
    ]
    lines = report.targets(rows, concurrency=256, step_ms=1.0).splitlines()
    cells = {line.strip("| ").split(" | ")[2]: line.strip("| ").split(" | ")[3:] for line in lines[2:]}
    # server's, reference, ratio, target, met (best rounds), rounds met, in-process
    assert cells["tokens/s vs SSE"] == ["150", "100", "1.50", ">= 1.37", "yes", "3/3", "1.60"]
    assert cells["p99 TTFT vs SSE"] == ["70", "100", "0.70", "<= 0.74", "yes", "2/3", "0.60"]
    assert cells["TTFT stddev vs SSE"] == ["60", "100", "0.60", "<= 0.66", "yes", "1/3", "0.50"]
    assert cells["tokens/s vs in-process"] == ["150", "160", "0.94", ">= 0.9", "yes", "2/3", "-"]


def test_rows_without_rounds_leave_the_column_empty() -> None:
    rows = [_target_row("grpc", [(150.0, 70.0, 60.0)]), _target_row("sse", [(100.0, 100.0, 100.0)])]
    for row in rows:
        del row["rounds"]
    lines = report.targets(rows, concurrency=256, step_ms=1.0).splitlines()
    assert [line.strip("| ").split(" | ")[8] for line in lines[2:]] == ["-", "-", "-"]


def _cpu_row(server: str, rounds: list[tuple[float, float]]) -> dict[str, Any]:
    """A best-of-rounds row (the first round) with (frontend, core) CPU us per token for each round."""
    every = [{"frontend_cpu_us_per_token": f, "core_cpu_us_per_token": c} for f, c in rounds]
    return {"engine": "tiny", "server": server, "concurrency": 256, **every[0],
            "server_cpu_us_per_token": sum(rounds[0]), "rounds": every}


def test_cpu_split_table_compares_frontends_and_shows_the_core_spread() -> None:
    rows = [
        _cpu_row("grpc", [(12.0, 60.0), (13.0, 52.0)]),
        _cpu_row("sse", [(36.0, 58.0), (35.0, 63.0)]),
        _cpu_row("inproc", [(10.0, 55.0), (11.0, 64.0)]),
        # a server whose tree had no named core process: no split, no line
        {"engine": "tiny", "server": "grpc-ids", "concurrency": 256, "server_cpu_us_per_token": 70.0,
         "frontend_cpu_us_per_token": math.nan, "core_cpu_us_per_token": math.nan},
    ]
    lines = report.cpu_split(rows, concurrency=256, step_ms=1.0).splitlines()
    cells = {line.strip("| ").split(" | ")[1]: line.strip("| ").split(" | ")[2:] for line in lines[2:]}
    # server CPU, frontend, core, frontend vs in-process, vs SSE, frontend by round, core by round
    assert cells["engine-server (gRPC)"] == ["72.0", "12.0", "60.0", "1.20", "0.33", "12.0-13.0", "52.0-60.0"]
    assert cells["HTTP/SSE reference"] == ["94.0", "36.0", "58.0", "3.60", "1.00", "35.0-36.0", "58.0-63.0"]
    assert cells["in-process"] == ["65.0", "10.0", "55.0", "1.00", "0.28", "10.0-11.0", "55.0-64.0"]
    assert len(cells) == 3
