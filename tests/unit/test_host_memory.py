"""The CPU KV cache's memory: zeroed, aligned to huge pages, huge pages where the system grants them, faulted
in when allocated."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch
from engine_server.engine import host_memory

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps_kib(address: int, field: str) -> int | None:
    """A field (kB) of the mapping holding `address` in /proc/self/smaps (None: no such mapping)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            mapping = int(head[1], 16) <= address < int(head[2], 16)
        elif mapping and line.startswith(f"{field}:"):
            return int(line.split()[1])
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_are_zero_aligned_writable_and_of_the_asked_shape(dtype: torch.dtype) -> None:
    t = host_memory.zeros((5, 16, 3, 7), dtype)
    assert t.shape == (5, 16, 3, 7)
    assert t.dtype == dtype
    assert t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    assert not t.any()
    t.view(-1)[-1] = 3
    t.view(-1, 7)[2].index_copy_(0, torch.tensor([1]), torch.tensor([5.0], dtype=dtype))
    assert float(t.sum()) == 8.0


def test_memory_outlives_every_name_but_the_tensor() -> None:
    t = host_memory.zeros((1024,), torch.float32)
    view = t[10:20]
    del t
    gc.collect()
    view.fill_(2.0)  # the mapping is still there (a freed one would fault)
    assert float(view.sum()) == 20.0


def test_the_memory_is_resident_before_anything_touches_it() -> None:
    nbytes = 3 * host_memory.HUGE_PAGE + 12345 * 4  # a last page only partly used
    t = host_memory.zeros((nbytes // 4,), torch.float32)
    resident = _smaps_kib(t.data_ptr(), "Rss")
    assert resident is not None
    assert resident * 1024 >= nbytes, f"Rss {resident} kB of a {nbytes}-byte tensor"
    assert not t.any()


def test_an_empty_shape_is_an_empty_tensor() -> None:
    assert host_memory.zeros((0, 16), torch.float32).shape == (0, 16)


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="transparent huge pages are off on this system")
def test_touched_memory_is_backed_by_huge_pages() -> None:
    t = host_memory.zeros((4 * host_memory.HUGE_PAGE // 4,), torch.float32)  # 4 huge pages of float32
    t.fill_(1.0)
    huge = _smaps_kib(t.data_ptr(), "AnonHugePages")
    assert huge is not None
    assert huge >= 2048, f"AnonHugePages {huge} kB in the KV cache's mapping"
