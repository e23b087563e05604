"""Both clients against a real engine-server: greedy output equals transformers' own, n>1, logprobs, stops."""

from __future__ import annotations

import pytest
from client_servers import GreedyReference
from engine_client import AsyncEngineClient, EngineClient, FinishReason, GenerateResult
from serverproc import RunningServer

PROMPT = "The quick brown fox"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompt_ids(reference: GreedyReference) -> tuple[int, ...]:
    assert reference.max_tokens == MAX_TOKENS
    return reference.prompt_ids


@pytest.fixture(scope="module")
def reference_ids(reference: GreedyReference) -> list[int]:
    return reference.output_ids


async def test_async_streaming_greedy_equals_reference(
    reference_ids: list[int], prompt_ids: tuple[int, ...], engine_server: RunningServer
) -> None:
    async with AsyncEngineClient(engine_server.target, timeout=60) as client:
        stream = client.generate(token_ids=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0)
        chunks = [c async for c in stream]
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == reference_ids
        assert "".join(c.text for c in chunks) == await client.detokenize(ids)
    assert sum(c.finish_reason is not None for c in chunks) == 1
    assert chunks[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_sync_non_streaming_greedy_equals_reference(engine_server: RunningServer, prompt_ids: tuple[int, ...],
                                                    reference_ids: list[int]) -> None:
    with EngineClient(engine_server.target, timeout=60) as client:
        result = client.complete(token_ids=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0)
        by_text = client.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
        by_ids = client.complete(token_ids=client.tokenize(PROMPT).token_ids, max_tokens=MAX_TOKENS,
                                 temperature=0.0)
    assert list(result.token_ids) == reference_ids
    assert by_text.token_ids == by_ids.token_ids  # text input = its tokenization


def _check_n(result: GenerateResult, n: int, max_tokens: int) -> None:
    assert [c.index for c in result.completions] == list(range(n))
    assert all(len(c.token_ids) == max_tokens for c in result.completions)
    assert all(c.finish_reason is FinishReason.LENGTH for c in result.completions)
    assert result.usage is not None
    assert result.usage.completion_tokens == n * max_tokens


async def test_n_completions_both_clients(engine_server: RunningServer) -> None:
    async with AsyncEngineClient(engine_server.target, timeout=60) as aclient:
        streamed = await aclient.generate(PROMPT, max_tokens=6, n=3, temperature=1.0, seed=11,
                                          ignore_eos=True).collect()
    with EngineClient(engine_server.target, timeout=60) as client:
        whole = client.complete(PROMPT, max_tokens=6, n=3, temperature=1.0, seed=11, ignore_eos=True)
    _check_n(streamed, 3, 6)
    _check_n(whole, 3, 6)
    # same seed, same request -> same tokens, streamed or not
    assert [c.token_ids for c in streamed.completions] == [c.token_ids for c in whole.completions]


def test_logprobs(engine_server: RunningServer, reference_ids: list[int],
                  prompt_ids: tuple[int, ...]) -> None:
    with EngineClient(engine_server.target, timeout=60) as client:
        result = client.complete(token_ids=prompt_ids, max_tokens=5, temperature=0.0, logprobs=2)
    logprobs = result.completions[0].logprobs
    assert logprobs is not None
    assert [lp.token_id for lp in logprobs] == reference_ids[:5] == list(result.token_ids)
    for lp in logprobs:
        assert lp.rank == 1  # greedy picks the most likely token
        assert len(lp.top) == 2
        assert lp.top[0].token_id == lp.token_id
        assert lp.logprob <= 0.0
        assert lp.top[0].logprob >= lp.top[1].logprob


async def test_stop_string_cuts_the_text(engine_server: RunningServer, prompt_ids: tuple[int, ...]) -> None:
    async with AsyncEngineClient(engine_server.target, timeout=60) as client:
        full = await client.complete(token_ids=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0)
        text = full.text
        # a 2-character stop string from the middle of the greedy text (no partial-UTF-8 replacement chars)
        start = next(i for i in range(3, len(text) - 2)
                     if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())
        stop = text[start:start + 2]
        cut = await client.complete(token_ids=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0, stop=stop)
        kept = await client.complete(token_ids=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0,
                                     stop=[stop], include_stop_string=True)
    assert cut.finish_reason is FinishReason.STOP
    assert cut.completions[0].stop == stop
    assert cut.text == text[:text.find(stop)]
    assert kept.text == text[:text.find(stop)] + stop
