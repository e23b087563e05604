"""A process whose engine runs on CPU never loads triton (it comes with torch's CUDA wheels).

Why: our GPU-only modules (triton_decode.py, decode_graphs.py) are imported by the model runner on CUDA only,
but transformers' modeling_utils imports torch._dynamo, whose module-level `has_triton_package()` probe
imports triton whenever it is installed. Loaded for nothing on a CPU machine, triton's nanobind extension
then printed its "leaked instances / types / functions" reports (hundreds of lines) when the process ended
normally (`engine-server --in-process-engine` on SIGTERM), and it cost ~0.13 s and ~70 MiB of RSS at start.

How: `sys.modules["triton"] = None`, the import system's documented way to make `import triton` raise
ImportError; the probe then answers False, and torch treats triton as absent (true in effect: nothing on a
CPU can run a Triton kernel, bar the interpreter the tests use).
NOTE: process-wide and for good, so only processes that are the engine's own call it (the engine core's
process, and engine-server with --in-process-engine), never a library user's (a test's, where Triton's
interpreter may run): hence not in `LLMEngine`.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

GPU_ONLY_PACKAGES = ("triton",)


def keep_gpu_modules_out(device: str) -> None:
    """On a CPU engine (`device` "cpu"), make the GPU-only packages unimportable in this process."""
    if device.startswith("cuda"):
        return
    for name in GPU_ONLY_PACKAGES:
        if sys.modules.get(name) is not None:
            logger.debug("%s was imported before the engine could keep it out", name)
            continue
        sys.modules[name] = None  # type: ignore[assignment]  # (None: "not importable")
