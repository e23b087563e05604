"""Prefix-cache events against the block manager: what a subscriber rebuilds from them is the cache itself.

A random workload (shared prefixes, salts, evictions under memory pressure, flushes) runs on a real
BlockManager with recording on; after every step the events are applied to a plain dict, which must equal the
cache (hash -> tokens, parent, salt). So every block stored is removed or cleared exactly when the cache
drops it. The publisher numbers batches without gaps and answers a subscription with a snapshot.
"""

from __future__ import annotations

import random

from engine_server.core.cache_messages import CacheEventBatch, CacheEventsStart
from engine_server.core.cache_publisher import CachePublisher
from engine_server.engine.block_manager import BlockManager, cache_root
from engine_server.engine.kv_events import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    CachedBlock,
    CacheEvent,
    snapshot_events,
)
from engine_server.engine.sequence import Sequence
from engine_server.engine.types import SamplingParams

BLOCK_SIZE = 4

Mirror = dict[int, tuple[tuple[int, ...], int | None, str]]  # hash -> (tokens, parent, salt)


def _seq(seq_id: int, tokens: list[int], salt: str = "") -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, params=SamplingParams(),
                    token_ids=list(tokens), num_prompt_tokens=len(tokens), max_tokens=16,
                    cache_root=cache_root(salt), cache_salt=salt)


def apply(mirror: Mirror, events: list[CacheEvent]) -> None:
    for event in events:
        if isinstance(event, BlocksStored):
            parent = event.parent_hash
            assert len(event.block_hashes) == len(event.token_ids) > 0
            for block_hash, tokens in zip(event.block_hashes, event.token_ids, strict=True):
                assert block_hash not in mirror, "stored twice without a removal"
                assert len(tokens) == BLOCK_SIZE
                mirror[block_hash] = (tokens, parent, event.cache_salt)
                parent = block_hash
        elif isinstance(event, BlocksRemoved):
            for block_hash in event.block_hashes:
                assert block_hash in mirror, "removed a block never stored"
                del mirror[block_hash]
        else:
            assert isinstance(event, CacheCleared)
            mirror.clear()


def cache_state(bm: BlockManager) -> Mirror:
    return {h: (tokens, parent, salt) for h, parent, tokens, salt in bm.cached_blocks()}


def _run_workload(bm: BlockManager, rng: random.Random, num_steps: int, on_step: object) -> None:
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(6)]
    live: list[Sequence] = []
    for step in range(num_steps):
        # 1) a few admissions with shared prefixes (and two salts), freeing the oldest when memory is short
        for _ in range(rng.randrange(3)):
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            seq = _seq(step * 10 + len(live), tokens, rng.choice(["", "", "tenant-a"]))
            cached, hashes = bm.match_prefix(seq)
            while not bm.can_admit(cached, seq.num_tokens) and live:
                bm.free(live.pop(0))
            if not bm.can_admit(cached, seq.num_tokens):
                continue
            bm.admit(seq, cached, hashes)
            assert bm.ensure_blocks(seq, seq.num_tokens)
            live.append(seq)
        # 2) computation in chunks: blocks become full and are registered
        for seq in live:
            seq.num_computed_tokens = min(seq.num_tokens, seq.num_computed_tokens + rng.choice([3, 4, 9]))
            bm.register_full_blocks(seq)
        # 3) decodes grow some sequences (new blocks, evictions), finishes free others, rare flushes
        for seq in list(live):
            if seq.num_computed_tokens == seq.num_tokens and rng.random() < 0.5:
                seq.token_ids.append(rng.randrange(50))
                if not bm.ensure_blocks(seq, seq.num_tokens):
                    live.remove(seq)
                    bm.free(seq)
            elif rng.random() < 0.2:
                live.remove(seq)
                bm.free(seq)
        if rng.random() < 0.03:
            bm.flush()
        on_step(step)  # type: ignore[operator]


def test_events_rebuild_the_cache_after_every_step() -> None:
    for seed in range(5):
        rng = random.Random(seed)
        bm = BlockManager(24, BLOCK_SIZE, enable_prefix_caching=True)
        bm.cache_events.start()
        mirror: Mirror = {}
        kinds: set[type] = set()

        def on_step(_step: int, bm: BlockManager = bm, mirror: Mirror = mirror,
                    kinds: set[type] = kinds) -> None:
            events = bm.cache_events.take()
            kinds.update(type(event) for event in events)
            apply(mirror, events)
            assert mirror == cache_state(bm)

        _run_workload(bm, rng, 300, on_step)
        assert kinds == {BlocksStored, BlocksRemoved, CacheCleared}  # the workload exercised all three
        # Every stored block is eventually removed or cleared: a final flush leaves nothing behind.
        bm.flush()
        apply(mirror, bm.cache_events.take())
        assert mirror == {} == cache_state(bm)


def test_nothing_is_recorded_while_not_recording() -> None:
    bm = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    seq = _seq(0, list(range(9)))
    assert bm.ensure_blocks(seq, 9)
    seq.num_computed_tokens = 9
    bm.register_full_blocks(seq)
    bm.flush()
    assert bm.cache_events.take() == []
    # ...but a snapshot taken later still knows each cached block's parent and salt
    salted = _seq(1, list(range(9)), "s")
    assert bm.ensure_blocks(salted, 9)
    salted.num_computed_tokens = 9
    bm.register_full_blocks(salted)
    (first, second) = sorted(bm.cached_blocks(), key=lambda b: b[1] is not None)
    assert first[1] is None
    assert second[1] == first[0]
    assert first[3] == second[3] == "s"


def test_snapshot_lists_parents_before_children_in_chains() -> None:
    blocks: list[CachedBlock] = [(3, 2, (3,), ""), (1, None, (1,), ""), (2, 1, (2,), ""),
                                 (9, None, (9,), "x"), (4, 77, (4,), "")]
    events = snapshot_events(blocks)
    assert events[0] == CacheCleared()
    stored = [e for e in events[1:] if isinstance(e, BlocksStored)]
    assert BlocksStored((1, 2, 3), None, ((1,), (2,), (3,)), "") in stored
    assert BlocksStored((9,), None, ((9,),), "x") in stored
    assert BlocksStored((4,), 77, ((4,),), "") in stored  # its parent is gone: listed as it was stored
    assert sum(len(e.block_hashes) for e in stored) == 5


def test_publisher_numbers_batches_without_gaps_and_snapshots_each_subscription() -> None:
    rng = random.Random(7)
    bm = BlockManager(24, BLOCK_SIZE, enable_prefix_caching=True)
    sent: list[tuple[int, CacheEventBatch | CacheEventsStart]] = []
    publisher = CachePublisher(bm, lambda index, message: sent.append((index, message)))
    mirrors: dict[int, Mirror] = {}
    numbers: dict[int, list[int]] = {0: [], 1: []}

    def deliver() -> None:
        for index, message in sent:
            if isinstance(message, CacheEventsStart):
                mirrors[index] = {}
                apply(mirrors[index], message.events)
            else:
                apply(mirrors[index], message.events)
            numbers[index].append(message.sequence_number)
        sent.clear()

    subscribed: set[int] = set()
    changes = {20: (0, True), 60: (1, True), 120: (0, False)}

    def on_step(step: int) -> None:
        if step in changes:
            index, subscribe = changes[step]
            publisher.set_subscribed(index, subscribe)
            (subscribed.add if subscribe else subscribed.discard)(index)
        publisher.publish()
        deliver()
        for index in subscribed:
            assert mirrors[index] == cache_state(bm)

    _run_workload(bm, rng, 200, on_step)
    for index in (0, 1):
        seen = numbers[index]
        assert seen == list(range(seen[0], seen[0] + len(seen))), "a gap or a repeat"
    # frontend 1 joined while frontend 0 listened: its snapshot carries the current number, not a new one
    assert numbers[1][0] in numbers[0]
    # unsubscribed by all, then again: recording resumes under a new number (the cache changed unrecorded)
    publisher.set_subscribed(1, False)
    assert not bm.cache_events.is_recording
    last = numbers[1][-1]
    publisher.set_subscribed(1, True)
    (_, start), = sent
    assert isinstance(start, CacheEventsStart)
    assert start.sequence_number == last + 1
    assert start.instance_id == publisher.instance_id
    assert start.block_size == BLOCK_SIZE


def test_no_prefix_cache_publishes_an_empty_snapshot_and_nothing_else() -> None:
    bm = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    sent: list[tuple[int, CacheEventBatch | CacheEventsStart]] = []
    publisher = CachePublisher(bm, lambda index, message: sent.append((index, message)))
    publisher.set_subscribed(0, True)
    seq = _seq(0, list(range(9)))
    assert bm.ensure_blocks(seq, 9)
    seq.num_computed_tokens = 9
    bm.register_full_blocks(seq)
    publisher.publish()
    (_, start), = sent
    assert isinstance(start, CacheEventsStart)
    assert start.events == [CacheCleared()]
