"""Both clients against a real engine-server: cache_salt, priority and flush_cache()."""

from __future__ import annotations

import random

import pytest
from engine_client import AsyncEngineClient, EngineClient, GenerateParams, InvalidRequestError
from serverproc import RunningServer

CACHED = 32  # a 40-token prompt: two full 16-token blocks can come from the prefix cache


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(40)]


def test_sync_cache_salt_priority_and_flush(engine_server: RunningServer) -> None:
    prompt = _prompt(9001)
    params = GenerateParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with EngineClient(engine_server.target, timeout=60) as client:
        def cached(salt: str | None, priority: int | None = None) -> int:
            result = client.complete(token_ids=prompt, params=params, cache_salt=salt, priority=priority)
            assert result.usage is not None
            return result.usage.cached_prompt_tokens

        assert cached("sdk-a") == 0
        assert cached("sdk-b") == 0
        assert cached("sdk-a", priority=-5) == CACHED
        assert client.flush_cache() >= 2
        assert cached("sdk-a", priority=5) == 0
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            client.complete(token_ids=prompt, params=params, cache_salt="x" * 257)


async def test_async_cache_salt_priority_and_flush(engine_server: RunningServer) -> None:
    prompt = _prompt(9002)
    async with AsyncEngineClient(engine_server.target, timeout=60) as client:
        async def cached(salt: str | None, priority: int | None = None) -> int:
            result = await client.complete(token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True,
                                           cache_salt=salt, priority=priority)
            assert result.usage is not None
            return result.usage.cached_prompt_tokens

        assert await cached(None) == 0
        assert await cached("sdk-c") == 0  # a salted request never sees the shared namespace's blocks
        assert await cached(None, priority=3) == CACHED
        assert await client.flush_cache() >= 2
        assert await cached(None) == 0
