"""CPU time of a process and all of its descendants, from /proc (Linux)."""

from __future__ import annotations

import os
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # NOTE: the command name (field 2) may hold spaces; everything after its closing paren splits cleanly.
    return text[text.rindex(")") + 2:].split()


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """utime + stime of each of the given processes that still lives (pass `descendants(root)` once, while
    they all live)."""
    found = {}
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            found[pid] = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15 of stat)
    return found


def tree_cpu_seconds(pids: list[int]) -> float:
    return sum(cpu_seconds(pids).values())


def process_name(pid: int) -> str:
    """The kernel's name of the process (/proc/PID/comm; the server's processes set theirs: proc_title.py)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
