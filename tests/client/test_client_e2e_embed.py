"""Embed through both clients against a real engine-server serving the MiniLM embedding model."""

from __future__ import annotations

import math

import pytest
from engine_client import AsyncEngineClient, EngineClient, InvalidRequestError, ModelTask
from serverproc import RunningServer


def _cos(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


async def test_async_embed(embed_server: RunningServer) -> None:
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply."]
    async with AsyncEngineClient(embed_server.target, timeout=60) as client:
        info = await client.model_info()
        assert info.task is ModelTask.EMBED
        result = await client.embed(texts)
        with pytest.raises(InvalidRequestError):
            await client.complete("Hello", max_tokens=2)
    vectors = [e.values for e in result.embeddings]
    assert [len(v) for v in vectors] == [info.embedding_dimension] * 3
    assert info.embedding_dimension == 384
    # normalize defaults to on
    assert all(math.isclose(math.sqrt(_cos(v, v)), 1.0, rel_tol=1e-4) for v in vectors)
    assert _cos(vectors[0], vectors[1]) > _cos(vectors[0], vectors[2])
    assert result.usage is not None
    assert result.usage.prompt_tokens == sum(e.num_tokens for e in result.embeddings)


def test_sync_embed_token_ids_equal_text(embed_server: RunningServer) -> None:
    with EngineClient(embed_server.target, timeout=60) as client:
        ids = client.tokenize("A man is eating food.").token_ids
        by_text = client.embed("A man is eating food.")
        by_ids = client.embed([list(ids)], normalize=False)
    assert by_text.embeddings[0].num_tokens == len(ids)
    raw = by_ids.embeddings[0].values
    norm = math.sqrt(_cos(raw, raw))
    assert [x / norm for x in raw] == pytest.approx(list(by_text.embeddings[0].values), abs=1e-5)
