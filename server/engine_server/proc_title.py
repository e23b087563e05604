"""Names the server's processes, so `ps`, `top` and /proc tell the engine core from the API frontends.

Without it every spawned process reads `python -c from multiprocessing.spawn import ...`. setproctitle sets
the command line that `ps` shows and, on Linux, the kernel's 15-character process name (/proc/PID/comm) that
`top` and the frontend benchmark's CPU split read (vLLM names its processes the same way).
"""

from __future__ import annotations

import os

ENGINE_CORE = "engine-core"


def api_worker(index: int) -> str:
    """The title of the `--api-workers` frontend process number `index` (the primary keeps its own)."""
    return f"engine-api-{index}"


def set_process_title(title: str) -> None:
    """Call first thing in a process's entry point (spawned processes only: the title is the process's)."""
    # NOTE: by default setproctitle makes room for a long title by moving the environment, which blanks
    # /proc/PID/environ (what an operator reads to see e.g. the core's OMP_WAIT_POLICY). SPT_NOENV keeps it:
    # the title then fits in the original command line, which a spawned process's is long enough for.
    os.environ.setdefault("SPT_NOENV", "1")
    import setproctitle

    setproctitle.setproctitle(title)
