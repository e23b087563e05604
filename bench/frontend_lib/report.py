"""Markdown tables, the target check and the PNG plots of the frontend benchmark."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

SERVER_LABELS = {"grpc": "engine-server (gRPC)", "grpc-ids": "engine-server (gRPC), token ids only",
                 "grpc-text": "engine-server (gRPC), text prompts",
                 "grpc2": "engine-server --api-workers 2",
                 "sse": "HTTP/SSE reference", "inproc": "in-process"}
ENGINE_LABELS = {"sim": "simulated engine", "tiny": "tiny model"}


def sim_step_ms(engine: str, default_ms: float) -> float | None:
    """The step time of a simulated engine ("sim": the default; "simN": N ms), None for a real one."""
    if not engine.startswith("sim"):
        return None
    return float(engine[3:]) if engine[3:] else default_ms


def engine_label(engine: str, default_ms: float) -> str:
    step = sim_step_ms(engine, default_ms)
    return ENGINE_LABELS.get(engine, engine) if step is None else f"simulated engine, {step:g} ms steps"
COLUMNS = (
    ("tok/s", "tokens_per_s", "{:.0f}"), ("req/s", "requests_per_s", "{:.2f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("p90", "ttft_p90_ms", "{:.0f}"),
    ("p99", "ttft_p99_ms", "{:.0f}"), ("stddev", "ttft_std_ms", "{:.0f}"),
    ("ITL mean ms", "itl_mean_ms", "{:.1f}"), ("ITL p99", "itl_p99_ms", "{:.1f}"),
    ("msgs/req", "messages_per_request", "{:.0f}"),
    ("server CPU us/token", "server_cpu_us_per_token", "{:.1f}"),
    ("of which frontend", "frontend_cpu_us_per_token", "{:.1f}"),
    ("server CPU %", "server_cpu_pct", "{:.0f}"),
    ("loadgen CPU %", "client_cpu_pct", "{:.0f}"),
)
Row = dict[str, Any]


def table(rows: list[Row], engine: str) -> str:
    lines = ["| server | streams | " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|---|---:|" + "---:|" * len(COLUMNS)]
    for row in rows:
        if row["engine"] != engine:
            continue
        cells = []
        for _, key, fmt in COLUMNS:
            value = row.get(key)
            cells.append("-" if value is None or (isinstance(value, float) and math.isnan(value))
                         else fmt.format(value))
        lines.append(f"| {SERVER_LABELS.get(row['server'], row['server'])} | {row['concurrency']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _find(rows: list[Row], engine: str, server: str, concurrency: int) -> Row | None:
    for row in rows:
        if (row["engine"], row["server"], row["concurrency"]) == (engine, server, concurrency):
            return row
    return None


# the targets: (name, reference server, metric, comparison, bound)
CHECKS = (
    ("tokens/s vs SSE", "sse", "tokens_per_s", ">=", 1.37),
    ("p99 TTFT vs SSE", "sse", "ttft_p99_ms", "<=", 0.74),
    ("TTFT stddev vs SSE", "sse", "ttft_std_ms", "<=", 0.66),
    ("tokens/s vs in-process", "inproc", "tokens_per_s", ">=", 0.9),
)
TARGET_KEYS = tuple(dict.fromkeys(check[2] for check in CHECKS))
CPU_KEYS = ("frontend_cpu_us_per_token", "core_cpu_us_per_token")
ROUND_KEYS = TARGET_KEYS + CPU_KEYS  # what each round keeps (`rounds` in a row)


def _met(ratio: float, op: str, bound: float) -> bool:
    return ratio >= bound if op == ">=" else ratio <= bound


def rounds_met(ours: Row, ref: Row, key: str, op: str, bound: float) -> str:
    """In how many rounds the target held, each round's server against the reference's same round ("-" where
    the rows carry no rounds): how far the best rounds' verdict can be trusted on a noisy machine."""
    pairs = [(a[key], b[key]) for a, b in zip(ours.get("rounds", []), ref.get("rounds", []), strict=False)
             if b[key]]
    if not pairs:
        return "-"
    return f"{sum(_met(a / b, op, bound) for a, b in pairs)}/{len(pairs)}"


def targets(rows: list[Row], *, concurrency: int, step_ms: float,
            grpc: tuple[str, ...] = ("grpc", "grpc-ids")) -> str:
    """The issue's targets at `concurrency` streams: ratios of engine-server (each gRPC client kind that ran)
    to the references, on each server's best round, then in how many paired rounds the target held. Next to
    a ratio to the SSE server, the in-process row's own ratio to it: what a frontend that cost nothing would
    reach on that engine (where it misses the target too, none can)."""
    lines = ["| engine | server | metric | server's | reference | ratio | target | met | rounds met "
             "| in-process |", "|---|---|---|---:|---:|---:|---|---|---:|---:|"]
    for engine in dict.fromkeys(row["engine"] for row in rows):
        for server in grpc:
            ours = _find(rows, engine, server, concurrency)
            if ours is None:
                continue
            for name, ref_server, key, op, bound in CHECKS:
                ref = _find(rows, engine, ref_server, concurrency)
                if ref is None or not ref[key]:
                    continue
                ratio = ours[key] / ref[key]
                met = _met(ratio, op, bound)
                label = SERVER_LABELS.get(server, server)
                inproc = _find(rows, engine, "inproc", concurrency) if ref_server != "inproc" else None
                ceiling = f"{inproc[key] / ref[key]:.2f}" if inproc is not None else "-"
                lines.append(f"| {engine_label(engine, step_ms)} | {label} | {name} | {ours[key]:.0f} | "
                             f"{ref[key]:.0f} | {ratio:.2f} | {op} {bound} | {'yes' if met else 'NO'} | "
                             f"{rounds_met(ours, ref, key, op, bound)} | {ceiling} |")
    return "\n".join(lines)


def _ms_and_ratio(row: Row, ref: Row | None, key: str) -> list[str]:
    value, base = row.get(key), ref.get(key) if ref is not None else None
    if value is None or math.isnan(value):
        return ["-", "-"]
    ratio = f"{value / base:.2f}" if base and not math.isnan(base) else "-"
    return [f"{value:.0f}", ratio]


def first_wave(rows: list[Row], *, concurrency: int, step_ms: float) -> str:
    """TTFT at `concurrency` streams split into the run's first wave (every stream's first request, sent at
    once) and the requests after it, each with its ratio to the SSE server: informative, next to the targets
    (which are on whole runs)."""
    keys = ("ttft_first_wave_max_ms", "ttft_after_first_wave_p99_ms", "ttft_after_first_wave_std_ms")
    lines = ["| engine | server | first wave: max ms | vs SSE | after it: p99 ms | vs SSE | stddev ms "
             "| vs SSE |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for engine in dict.fromkeys(row["engine"] for row in rows):
        ref = _find(rows, engine, "sse", concurrency)
        for server, label in SERVER_LABELS.items():
            row = _find(rows, engine, server, concurrency)
            if row is None or keys[0] not in row:
                continue
            cells = [cell for key in keys for cell in _ms_and_ratio(row, ref, key)]
            lines.append(f"| {engine_label(engine, step_ms)} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _spread(row: Row, key: str) -> str:
    values = [r[key] for r in row.get("rounds", []) if key in r and not math.isnan(r[key])]
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def cpu_split(rows: list[Row], *, concurrency: int, step_ms: float) -> str:
    """Server CPU per generated token at `concurrency` streams, split into the frontend process(es) and the
    engine core process, the frontend's ratio to the in-process row's (its "frontend": AsyncEngine and the
    client loop in the client's process) and to the SSE server's, then each over the rounds: the targets
    compare throughput, which on one shared core moves with the engine core's CPU cost as much as with the
    frontend's."""
    lines = ["| engine | server | server CPU us/token | frontend | core | frontend vs in-process "
             "| frontend vs SSE | frontend by round | core by round |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    key = "frontend_cpu_us_per_token"
    for engine in dict.fromkeys(row["engine"] for row in rows):
        inproc = _find(rows, engine, "inproc", concurrency)
        sse = _find(rows, engine, "sse", concurrency)
        for server, label in SERVER_LABELS.items():
            row = _find(rows, engine, server, concurrency)
            if row is None or math.isnan(row.get(key, math.nan)):
                continue
            ratios = [f"{row[key] / ref[key]:.2f}" if ref is not None and ref.get(key) else "-"
                      for ref in (inproc, sse)]
            core = "core_cpu_us_per_token"
            cells = [f"{row['server_cpu_us_per_token']:.1f}", f"{row[key]:.1f}", f"{row[core]:.1f}", *ratios,
                     _spread(row, key), _spread(row, core)]
            lines.append(f"| {engine_label(engine, step_ms)} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], engine: str, path: Path, *, step_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("tokens_per_s", "generated tokens/s"), ("ttft_p99_ms", "TTFT p99 (ms)"),
               ("ttft_std_ms", "TTFT stddev (ms)"), ("server_cpu_us_per_token", "server CPU us / token"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6))
    servers = sorted({r["server"] for r in rows if r["engine"] == engine})
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for server in servers:
            points = sorted((r["concurrency"], r[key]) for r in rows
                            if r["engine"] == engine and r["server"] == server)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    label=SERVER_LABELS.get(server, server))
        ax.set_xscale("log", base=2)
        if key in ("ttft_p99_ms", "server_cpu_us_per_token"):
            ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Frontend throughput, {engine_label(engine, step_ms)}", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_section(markdown: Path, section: str, *, start: str, end: str, heading: str) -> None:
    """Replaces the text between the markers, or appends the section (with its heading)."""
    text = markdown.read_text() if markdown.exists() else "# Benchmarks\n"
    block = f"{start}\n{section.rstrip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1]
        text = before + block + after
    else:
        text = text.rstrip() + f"\n\n{heading}\n\n{block}\n"
    markdown.write_text(text)
