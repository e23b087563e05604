"""Applying structured-output token masks: the compiled kernel, the torch path and a plain reference agree;
the min_tokens waiver's question (only stop tokens allowed?) is answered from the packed bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_server.engine.structured.masks import AllowedTokens
from engine_testutil import cpu_kernel_variant


def reference(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    out = logits.clone()
    for j, row in enumerate(rows):
        for token in range(logits.shape[1]):
            if not (int(bitmask[j, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


def random_case(seed: int, batch: int, vocab: int) -> tuple[torch.Tensor, list[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = sorted(rng.choice(batch, size=rng.integers(1, batch + 1), replace=False).tolist())
    words = (vocab + 31) // 32
    bitmask = rng.integers(-(2**31), 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    bitmask[0, :] = -1  # a row that allows everything
    if len(rows) > 1:
        bitmask[1, :] = 0  # and one that allows nothing
    return torch.from_numpy(rng.standard_normal((batch, vocab)).astype(np.float32)), rows, bitmask


@pytest.mark.parametrize(("batch", "vocab"), [(1, 31), (5, 32), (9, 1000), (17, 1024), (3, 8193)])
def test_kernel_and_torch_path_match_the_reference(batch: int, vocab: int) -> None:
    kernels = cpu_kernel_variant("native")
    for seed in range(3):
        logits, rows, bitmask = random_case(seed, batch, vocab)
        want = reference(logits, rows, bitmask)
        by_kernel = logits.clone()
        kernels.apply_token_bitmask(by_kernel, torch.tensor(rows), torch.from_numpy(bitmask))
        assert torch.equal(by_kernel, want)
        by_torch = logits.clone().to(torch.float64)  # float64 takes the torch path
        AllowedTokens(rows, bitmask).apply(by_torch)
        assert torch.equal(by_torch.to(torch.float32), want)
        by_allowed = logits.clone()
        AllowedTokens(rows, bitmask).apply(by_allowed)
        assert torch.equal(by_allowed, want)


def test_kernel_refuses_bad_shapes() -> None:
    kernels = cpu_kernel_variant("native")
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="row out of range"):
        kernels.apply_token_bitmask(logits, torch.tensor([2]), torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="narrower"):
        kernels.apply_token_bitmask(logits, torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="one row per entry"):
        kernels.apply_token_bitmask(logits, torch.tensor([0, 1]), torch.zeros(1, 2, dtype=torch.int32))


def test_only_stops_allowed() -> None:
    bitmask = np.zeros((3, 2), dtype=np.int32)
    bitmask[0, 0] = 1 << 1  # token 1 only
    bitmask[1, 0] = (1 << 1) | (1 << 5)  # tokens 1 and 5
    bitmask[2, 1] = np.uint32(1 << 31).astype(np.int32)  # token 63 only
    allowed = AllowedTokens([0, 1, 2], bitmask)
    assert allowed.only_stops_allowed(0, [1])
    assert not allowed.only_stops_allowed(1, [1])
    assert allowed.only_stops_allowed(1, [1, 5])
    assert allowed.only_stops_allowed(2, [63])
    assert not allowed.only_stops_allowed(2, [1])
    assert bitmask[1, 0] == (1 << 1) | (1 << 5)  # the question leaves the mask as it was
