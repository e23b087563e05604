"""CacheEventHub against a CachePublisher over a real BlockManager (the core's side, run inline): snapshots,
resumes, cursors it cannot serve, a subscriber that falls behind, the core subscription's life."""

from __future__ import annotations

import asyncio

import pytest
from engine_server.core.cache_messages import CacheEventBatch, CacheEventsCommand, CacheEventsStart
from engine_server.core.cache_publisher import CachePublisher
from engine_server.engine.block_manager import BlockManager
from engine_server.engine.kv_events import BlocksStored, CacheEvent
from engine_server.engine.sequence import Sequence
from engine_server.engine.types import EngineDead, SamplingParams
from engine_server.frontend.cache_events import (
    CacheBatch,
    CacheEventHub,
    CursorOutOfRange,
    SubscriberFellBehind,
    TooManySubscriptions,
)

BLOCK_SIZE = 4


class FakeCore:
    """The core loop's cache side: commands applied at once, messages delivered on the next loop turn."""

    def __init__(self) -> None:
        self.bm = BlockManager(64, BLOCK_SIZE, enable_prefix_caching=True)
        self.publisher = CachePublisher(self.bm, self._deliver)
        self.commands: list[bool] = []
        self.hub: CacheEventHub | None = None
        self._next_id = 0

    def send_command(self, command: CacheEventsCommand) -> None:
        self.commands.append(command.subscribe)
        self.publisher.set_subscribed(0, command.subscribe)

    def _deliver(self, _index: int, message: CacheEventBatch | CacheEventsStart) -> None:
        assert self.hub is not None
        if isinstance(message, CacheEventsStart):
            asyncio.get_running_loop().call_soon(self.hub.on_start, message)
        else:
            asyncio.get_running_loop().call_soon(self.hub.on_batch, message)

    def step(self, tokens: list[int]) -> None:
        """A sequence computed whole and finished: its full blocks are cached (and may evict others)."""
        seq = Sequence(seq_id=self._next_id, request_id=f"r{self._next_id}", index=0, params=SamplingParams(),
                       token_ids=list(tokens), num_prompt_tokens=len(tokens), max_tokens=1)
        self._next_id += 1
        assert self.bm.ensure_blocks(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        self.bm.register_full_blocks(seq)
        self.bm.free(seq)
        self.publisher.publish()


def make(**options: float) -> tuple[FakeCore, CacheEventHub]:
    core = FakeCore()
    hub = CacheEventHub(core.send_command, **options)  # type: ignore[arg-type]
    core.hub = hub
    return core, hub


def tokens(seed: int) -> list[int]:
    return [seed * 100 + i for i in range(2 * BLOCK_SIZE + 1)]


def stored_hashes(batches: list[CacheBatch]) -> list[int]:
    events: list[CacheEvent] = [e for b in batches for e in b.events]
    return [h for e in events if isinstance(e, BlocksStored) for h in e.block_hashes]


async def drain() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_snapshot_then_live_batches_and_resume_after_a_cursor() -> None:
    core, hub = make(linger_s=0)
    core.step(tokens(1))  # before anyone subscribes: nothing recorded, but in the snapshot
    with await hub.subscribe(lambda _hub: None) as sub:
        (snapshot,) = await sub.get(1.0)
        assert snapshot.is_snapshot
        assert len(stored_hashes([snapshot])) == 2
        cursor = snapshot.sequence_number
        core.step(tokens(2))
        await drain()
        (live,) = await sub.get(1.0)
        assert live.sequence_number == cursor + 1
        assert not live.is_snapshot
        with await hub.subscribe(lambda _hub: cursor) as resumed:
            (replayed,) = await resumed.get(1.0)
            assert replayed == live
        with pytest.raises(CursorOutOfRange) as info:
            await hub.subscribe(lambda _hub: cursor + 5)
        assert info.value.is_future
    assert core.commands == [True, False]  # unsubscribed from the core once the last one left


async def test_a_cursor_older_than_the_replay_is_out_of_range() -> None:
    core, hub = make(replay_batches=2, linger_s=0)
    with await hub.subscribe(lambda _hub: None) as sub:
        start = (await sub.get(1.0))[0].sequence_number
        for seed in range(2, 6):
            core.step(tokens(seed))
        await drain()
        assert len(await sub.get(1.0)) == 4
        with pytest.raises(CursorOutOfRange) as info:
            await hub.subscribe(lambda _hub: start)
        assert not info.value.is_future
        assert hub.num_subscriptions == 1  # the refused one left nothing behind


async def test_a_subscriber_that_falls_behind_is_ended_and_the_others_go_on() -> None:
    core, hub = make(max_pending=3, linger_s=0)
    with await hub.subscribe(lambda _hub: None) as slow, await hub.subscribe(lambda _hub: None) as fast:
        for seed in range(2, 8):
            core.step(tokens(seed))
            await drain()
            assert await fast.get(1.0)
        with pytest.raises(SubscriberFellBehind):
            await slow.get(1.0)
        core.step(tokens(9))
        await drain()
        assert await fast.get(1.0)


async def test_limits_failure_and_linger() -> None:
    core, hub = make(max_subscriptions=1, linger_s=0.05)
    sub = await hub.subscribe(lambda _hub: None)
    with pytest.raises(TooManySubscriptions):
        await hub.subscribe(lambda _hub: None)
    sub.close()
    sub.close()  # idempotent
    assert core.commands == [True]  # lingers...
    await asyncio.sleep(0.2)
    assert core.commands == [True, False]  # ...then leaves
    with await hub.subscribe(lambda _hub: None) as sub:
        hub.fail(EngineDead("gone"))
        await sub.get(1.0)  # the snapshot first
        with pytest.raises(EngineDead):
            await sub.get(1.0)
    with pytest.raises(EngineDead):
        await hub.subscribe(lambda _hub: None)
