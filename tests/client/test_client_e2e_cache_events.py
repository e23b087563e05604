"""Both clients' subscribe_cache_events() against a real engine-server: a snapshot, then the stored blocks of
a completion (token ids, salt), numbered without gaps; a resume at the next number; a number from the future
is InvalidRequestError."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from engine_client import (
    AsyncEngineClient,
    CacheBlocksStored,
    CacheEventBatch,
    EngineClient,
    InvalidRequestError,
)
from serverproc import RunningServer

BLOCK_SIZE = 16


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(3 * BLOCK_SIZE + 4)]


def _blocks(prompt: list[int]) -> set[tuple[int, ...]]:
    return {tuple(prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]) for i in range(len(prompt) // BLOCK_SIZE)}


def _stored(batch: CacheEventBatch, salt: str) -> set[tuple[int, ...]]:
    stored = [e for e in batch.events if isinstance(e, CacheBlocksStored) and e.cache_salt == salt]
    return {tokens for event in stored for tokens in event.token_ids}


def test_sync_subscribe_sees_a_completions_blocks(engine_server: RunningServer) -> None:
    prompt = _prompt(4242)
    with EngineClient(engine_server.target, timeout=60) as client:
        events = client.subscribe_cache_events(timeout=60)
        first = next(events)
        assert first.snapshot is not None
        assert first.snapshot.index == 0
        while first.snapshot.index + 1 < first.snapshot.count:
            first = next(events)
        done = threading.Event()

        def complete() -> None:
            client.complete(token_ids=prompt, max_tokens=2, temperature=0.0, cache_salt="sdk-events")
            done.set()

        threading.Thread(target=complete, daemon=True).start()
        seen: set[tuple[int, ...]] = set()
        last = first.sequence_number
        for batch in events:
            if batch.is_heartbeat:
                continue
            assert batch.sequence_number == last + 1
            last = batch.sequence_number
            seen |= _stored(batch, "sdk-events")
            if _blocks(prompt) <= seen:
                break
        events.close()  # cancels the call
        assert done.wait(60)
        with pytest.raises(InvalidRequestError):
            next(client.subscribe_cache_events(start_sequence_number=last + 1000,
                                               instance_id=first.instance_id))


async def test_async_subscribe_resumes_at_the_next_number(engine_server: RunningServer) -> None:
    prompt = _prompt(4343)
    async with AsyncEngineClient(engine_server.target, timeout=60) as client:
        events = client.subscribe_cache_events(timeout=60)
        snapshot = await anext(events)
        while snapshot.snapshot is not None and snapshot.snapshot.index + 1 < (snapshot.snapshot.count or 1):
            snapshot = await anext(events)
        await events.aclose()
        # away: the cache changes; back at the next number, the batches since then, without a gap
        await client.complete(token_ids=prompt, max_tokens=2, temperature=0.0)
        resumed = client.subscribe_cache_events(start_sequence_number=snapshot.sequence_number + 1,
                                                instance_id=snapshot.instance_id, timeout=60)
        seen: set[tuple[int, ...]] = set()
        last = snapshot.sequence_number
        async with asyncio.timeout(60):
            async for batch in resumed:
                if batch.is_heartbeat:
                    continue
                assert batch.snapshot is None
                assert batch.sequence_number == last + 1
                last = batch.sequence_number
                seen |= _stored(batch, "")
                if _blocks(prompt) <= seen:
                    break
        await resumed.aclose()
