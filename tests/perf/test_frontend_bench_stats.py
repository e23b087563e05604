"""The frontend benchmark's statistics (bench/frontend_lib): TTFT split into the first wave and the requests
after it, and the report table built from it."""

from __future__ import annotations

import math
import sys
from pathlib import Path

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
