"""The engine's own CPU kernels (csrc/), compiled on first use and cached per machine.

`load()` returns the compiled module (decode and prefill attention over the paged cache, fused RMSNorm and
SiLU-and-mul), or None when it cannot be had (no C++ compiler, a build error, ENGINE_CPU_KERNELS=0);
the engine then stays on its torch-only path, which gives the same results more slowly. The build
takes ~30 s once (2 vCPUs); the cache key covers the sources, the flags, torch, Python and this CPU's
instruction set (the code is built with -march=native), so a cache dir shared by different machines
never hands one another's binary.

Run `python -m engine_server.engine.cpu_kernels` to build ahead of time (CI and images do).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Protocol

import torch

from engine_server.models.tiny import cache_root

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# NOTE: -fopenmp makes at::parallel_for really parallel (it is a header template: without the flag it
# runs serially). At run time the extension binds to the libgomp torch already loaded (same soname).
_LDFLAGS = ["-fopenmp"]
DISABLE_ENV = "ENGINE_CPU_KERNELS"

_NAME = "engine_cpu_kernels"

_lock = threading.Lock()
_loaded: dict[str, CpuKernels | None] = {}


class CpuKernels(Protocol):
    """The compiled module's functions (csrc/ops.h says what each computes)."""

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               window: int, softcap: float, out: torch.Tensor) -> None: ...

    def paged_prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, starts: torch.Tensor, num_rows: torch.Tensor,
                                scale: float, window: int, softcap: float, out: torch.Tensor) -> None: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None: ...

    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None: ...

    def silu_and_mul_rows(self, gate_up: torch.Tensor, out: torch.Tensor) -> None: ...

    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         q_out: torch.Tensor, k_out: torch.Tensor) -> None: ...

    def apply_token_bitmask(self, logits: torch.Tensor, rows: torch.Tensor,
                            bitmask: torch.Tensor) -> None: ...

    def isa(self) -> str: ...  # "avx512" or "portable"


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sources() -> list[Path]:
    return sorted(p for p in _CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def _cache_dir(name: str, cflags: list[str]) -> Path:
    key = hashlib.sha256("\n".join([
        name, *(p.read_text() for p in _sources()), " ".join(cflags + _LDFLAGS), torch.__version__,
        sys.version, _cpu_signature(),
    ]).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"cpu-{key}"


def _import(name: str, path: Path) -> Any:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(final: Path, name: str, cflags: list[str]) -> Any:
    from torch.utils.cpp_extension import load

    final.parent.mkdir(parents=True, exist_ok=True)
    # torch runs `ninja` from PATH: the one this environment installed (a dependency) when not on it
    scripts = str(Path(sys.executable).parent)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [os.environ.get("PATH"), scripts]))
    # Built beside the destination and renamed (as the test models are): a reader never sees a
    # half-written library, concurrent builders both succeed, and a build killed midway leaves no
    # lock behind (torch's own build directory lock would make every later start wait on it).
    tmp = Path(tempfile.mkdtemp(prefix=".cpu-", dir=final.parent))
    try:
        module = load(name, sources=[str(p) for p in _sources() if p.suffix == ".cpp"], extra_cflags=cflags,
                      extra_ldflags=_LDFLAGS, build_directory=str(tmp), verbose=False)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / f"{name}.so").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return module


def load() -> CpuKernels | None:
    """The compiled kernels (built on first call), or None where they cannot be built or are disabled."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    with _lock:
        if _NAME not in _loaded:
            _loaded[_NAME] = _load()
    return _loaded[_NAME]


def _load(name: str = _NAME, extra_cflags: tuple[str, ...] = ()) -> CpuKernels | None:
    """`extra_cflags`: a variant of the build under its own module name (the tests build the portable code
    with -mno-avx512f, so the path CPUs without AVX-512 run is checked here too)."""
    cflags = _CFLAGS + list(extra_cflags)
    try:
        final = _cache_dir(name, cflags)
        library = final / f"{name}.so"
        if library.exists():
            module: CpuKernels = _import(name, library)
        else:
            log.info("compiling the engine's CPU kernels (once; cached in %s)", final)
            module = _build(final, name, cflags)
        log.info("the engine's CPU kernels: %s build", module.isa())
        return module
    except Exception as e:  # no compiler, headers or disk: the torch path gives the same results
        log.warning("the engine's CPU kernels are unavailable, using the torch path: %s", e)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if load() is not None else 1)
