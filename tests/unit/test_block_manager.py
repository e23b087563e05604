"""Block manager: allocation, ref counts, prefix-cache hits, LRU eviction of cached free blocks."""

from __future__ import annotations

import random
import tracemalloc
from collections import OrderedDict

import pytest
from engine_server.engine.block_manager import BlockManager, FreeBlocks, cache_root
from engine_server.engine.sequence import Sequence
from engine_server.engine.types import SamplingParams


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, params=SamplingParams(),
                    token_ids=list(tokens), num_prompt_tokens=len(tokens), max_tokens=16)


def _compute_all(bm: BlockManager, seq: Sequence) -> None:
    assert bm.ensure_blocks(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)


def test_allocate_and_free_returns_every_block() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = _seq(0, list(range(10)))
    assert bm.ensure_blocks(seq, 10)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5
    assert bm.ensure_blocks(seq, 12)  # still fits in 3 blocks
    assert bm.num_free_blocks == 5
    assert not bm.ensure_blocks(seq, 40)  # would need 10 blocks: refused, nothing changes
    assert len(seq.block_table) == 3
    bm.free(seq)
    assert bm.num_free_blocks == 8
    assert seq.block_table == []


def test_prefix_hit_shares_full_blocks_and_keeps_the_last_token_uncached() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    first = _seq(0, list(range(12)))
    _compute_all(bm, first)
    second = _seq(1, [*list(range(10)), 99, 98])
    cached, hashes = bm.match_prefix(second)
    assert cached == first.block_table[:2]  # [0..3], [4..7] match; [8, 9, 99, 98] does not
    assert bm.can_admit(cached, second.num_tokens)
    bm.admit(second, cached, hashes)
    assert second.num_computed_tokens == 8
    assert [bm.ref_counts[b] for b in cached] == [2, 2]
    # Identical 12-token prompt: at most 11 tokens may hit, so only 2 of the 3 full blocks do.
    third = _seq(2, list(range(12)))
    assert len(bm.match_prefix(third)[0]) == 2
    bm.free(first)
    bm.free(second)
    assert bm.num_free_blocks == 16


def test_cached_free_blocks_are_reused_on_hit_and_evicted_lru() -> None:
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = _seq(0, [1, 2, 3, 4, 5])
    _compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = _seq(1, [1, 2, 3, 4, 7])
    cached, hashes = bm.match_prefix(b)
    assert len(cached) == 2  # reused from the free list
    bm.admit(b, cached, hashes)
    assert bm.num_free_blocks == 2
    bm.free(b)
    # Fill the cache with other content: the old prefix gets evicted.
    c = _seq(2, [9, 9, 8, 8, 7, 7, 6, 6])
    _compute_all(bm, c)
    assert bm.match_prefix(_seq(3, [1, 2, 3, 4, 5]))[0] == []
    bm.free(c)
    assert bm.num_free_blocks == 4


def test_a_hit_in_the_middle_of_the_free_list_keeps_the_others_in_lru_order() -> None:
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    a = _seq(0, [1, 2, 3, 4, 5, 6])  # blocks 0, 1, 2
    b = _seq(1, [7, 8, 9, 10])  # blocks 3, 4
    _compute_all(bm, a)
    _compute_all(bm, b)
    bm.free(a)  # tails first: free order 5, 2, 1, 0
    bm.free(b)  # then 4, 3
    assert list(bm.free_block_ids) == [5, 2, 1, 0, 4, 3]
    hit = _seq(2, [1, 2, 3, 4, 99])
    cached, hashes = bm.match_prefix(hit)
    assert cached == [0, 1]
    bm.admit(hit, cached, hashes)
    assert list(bm.free_block_ids) == [5, 2, 4, 3]
    assert bm.ensure_blocks(hit, 5)  # one more block: the one freed longest ago
    assert hit.block_table == [0, 1, 5]
    fresh = _seq(3, [11, 12])
    assert bm.ensure_blocks(fresh, 2)
    assert fresh.block_table == [2]  # a's third block, evicted from the prefix cache
    assert bm.match_prefix(_seq(4, [1, 2, 3, 4, 5, 6, 0]))[0] == [0, 1]


def test_no_prefix_caching_means_no_hits() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = _seq(0, [1, 2, 3, 4, 5])
    _compute_all(bm, a)
    assert bm.match_prefix(_seq(1, [1, 2, 3, 4, 5]))[0] == []


def test_share_for_n_siblings_counts_references() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    parent = _seq(0, [1, 2, 3, 4, 5])
    _compute_all(bm, parent)
    child = _seq(1, [1, 2, 3, 4, 5])
    bm.share(parent, child, 2)
    assert child.block_table == parent.block_table[:2]
    assert child.num_computed_tokens == 4
    bm.free(parent)
    assert bm.num_free_blocks == 8 - 2  # the shared blocks are still the child's
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_the_free_list_is_lru_ordered_under_random_use() -> None:
    rng = random.Random(5)
    free = FreeBlocks(50)
    reference: OrderedDict[int, None] = OrderedDict.fromkeys(range(50))  # (what the free list was)
    used: list[int] = []
    for _ in range(5000):
        roll = rng.random()
        if roll < 0.4 and reference:  # the oldest
            block_id = free.pop_oldest()
            assert block_id == reference.popitem(last=False)[0]
            used.append(block_id)
        elif roll < 0.6 and reference:  # a prefix-cache hit on a free block
            block_id = rng.choice(list(reference))
            free.remove(block_id)
            del reference[block_id]
            used.append(block_id)
        elif used:
            block_id = used.pop(rng.randrange(len(used)))
            free.append(block_id)
            reference[block_id] = None
        assert len(free) == len(reference)
    assert list(free) == list(reference)
    assert all((block_id in free) == (block_id in reference) for block_id in range(-1, 52))
    for _ in range(len(reference)):
        free.pop_oldest()
    with pytest.raises(IndexError):
        free.pop_oldest()


def test_the_free_list_allocates_nothing_as_blocks_come_and_go() -> None:
    # An OrderedDict free list rebuilt its tables every ~27k frees (~1.8 MB at 16k blocks): the engine core's
    # heap, which keeps what it frees, grew ~1.25 MB each time (issue 37, item 4).
    bm = BlockManager(16384, 16, enable_prefix_caching=False)
    seqs = [_seq(i, [1, 2, 3]) for i in range(64)]
    tracemalloc.start()
    try:
        for step in range(40_000):  # each: a sequence's block freed, another taken (the oldest free one)
            seq = seqs[step % 64]
            bm.free(seq)
            assert bm.ensure_blocks(seq, 3)
            if step == 1000:
                tracemalloc.reset_peak()
                start = tracemalloc.get_traced_memory()[0]
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert current - start < 16_384, (start, current)
    assert peak - start < 16_384, (start, peak)


def _salted(seq_id: int, tokens: list[int], salt: str) -> Sequence:
    seq = _seq(seq_id, tokens)
    seq.cache_root = cache_root(salt)
    return seq


def test_blocks_are_shared_within_a_cache_salt_and_never_across_salts() -> None:
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    prompt = list(range(13))
    _compute_all(bm, _salted(0, prompt, "tenant-a"))
    assert len(bm.match_prefix(_salted(1, prompt, "tenant-a"))[0]) == 3
    assert bm.match_prefix(_salted(2, prompt, "tenant-b"))[0] == []
    assert bm.match_prefix(_salted(3, prompt, ""))[0] == []  # the shared namespace is a namespace too
    _compute_all(bm, _salted(4, prompt, ""))
    assert len(bm.match_prefix(_salted(5, prompt, ""))[0]) == 3
    assert bm.match_prefix(_salted(6, prompt, "tenant-b"))[0] == []


def test_the_cache_root_is_stable_and_distinct_from_the_shared_root() -> None:
    assert cache_root("") == 0
    assert cache_root("tenant-a") == cache_root("tenant-a") != 0  # a digest, not the per-process hash()
    assert cache_root("tenant-a") != cache_root("tenant-b")


def test_flush_forgets_free_and_used_cached_blocks_without_freeing_any() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    finished, running = _seq(0, list(range(9))), _seq(1, list(range(100, 109)))
    _compute_all(bm, finished)
    _compute_all(bm, running)
    bm.free(finished)
    num_free = bm.num_free_blocks
    assert bm.flush() == 4  # two full blocks each
    assert bm.num_free_blocks == num_free
    assert len(running.block_table) == 3
    assert bm.match_prefix(_seq(2, list(range(9))))[0] == []
    assert bm.match_prefix(_seq(3, list(range(100, 109))))[0] == []
    bm.free(running)  # freed uncached: still no hit
    assert bm.match_prefix(_seq(4, list(range(100, 109))))[0] == []
    assert bm.num_free_blocks == 16
    assert bm.flush() == 0
    # The cache works again after a flush.
    _compute_all(bm, _seq(5, list(range(9))))
    assert len(bm.match_prefix(_seq(6, list(range(9))))[0]) == 2
