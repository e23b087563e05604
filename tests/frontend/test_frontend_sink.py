"""RequestStream.set_sink: outputs pushed on the engine's output task, declined ones yielded in order."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import pytest
from engine_server.engine.types import SamplingParams
from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.outputs import GenerateOutput, GenerateRequest, PlainSink
from engine_server.frontend.tokenizer import Tokenizer

TIMEOUT = 10.0


def _request(tokenizer: Tokenizer, request_id: str, text: str) -> GenerateRequest:
    ids = tuple(tokenizer.encode(text, add_special_tokens=False).token_ids)
    return GenerateRequest(request_id, ids, SamplingParams(max_tokens=len(ids)))


def _ids(outputs: list[GenerateOutput]) -> list[int]:
    return [token_id for output in outputs for chunk in output.chunks for token_id in chunk.token_ids]


async def _yielded(engine: AsyncEngine, request: GenerateRequest, sink: Callable[[GenerateOutput], bool],
                   plain_sink: PlainSink | None = None) -> list[GenerateOutput]:
    """Runs `request` with the sinks set; what its iterator yielded (what the sinks did not take)."""
    stream = engine.generate(request)
    stream.set_sink(sink, plain_sink)
    async with asyncio.timeout(TIMEOUT):
        return [output async for output in stream]


async def test_a_sink_that_takes_everything_leaves_the_iterator_only_the_end(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    request = _request(tokenizer, "push-all", "one two three four five six seven eight")
    pushed: list[GenerateOutput] = []

    def take(output: GenerateOutput) -> bool:
        pushed.append(output)
        return True

    assert await _yielded(fake_engine, request, take) == []
    assert _ids(pushed) == list(request.prompt_token_ids)
    assert pushed[-1].finished
    assert not any(output.finished for output in pushed[:-1])


async def test_declined_outputs_come_through_the_iterator_in_order(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    request = _request(tokenizer, "push-some", "alpha beta gamma delta epsilon zeta eta theta iota kappa")
    delivered: list[GenerateOutput] = []  # in delivery order, whichever way each output came
    offered = num_pulled = 0

    def every_other(output: GenerateOutput) -> bool:
        nonlocal offered
        offered += 1
        if offered % 2:
            return False
        delivered.append(output)
        return True

    stream = fake_engine.generate(request)
    stream.set_sink(every_other)
    async with asyncio.timeout(TIMEOUT):
        async for output in stream:
            delivered.append(output)
            num_pulled += 1
    assert offered >= 2
    assert num_pulled >= 1
    # NOTE: while a declined output waits for the consumer, later ones wait behind it (not offered to the
    # sink), so every token arrives exactly once and in order.
    assert _ids(delivered) == list(request.prompt_token_ids)
    assert delivered[-1].finished


async def test_a_failing_sink_falls_back_to_the_iterator(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    request = _request(tokenizer, "push-broken", "the sink raises but the stream survives intact")

    def broken(output: GenerateOutput) -> bool:
        raise RuntimeError("sink bug")

    yielded = await _yielded(fake_engine, request, broken)
    assert _ids(yielded) == list(request.prompt_token_ids)
    assert yielded[-1].finished
    # the engine's output task survived: the next request is served
    again = _request(tokenizer, "after-broken", "still serving")
    async with asyncio.timeout(TIMEOUT):
        assert _ids([o async for o in fake_engine.generate(again)]) == list(again.prompt_token_ids)


async def test_plain_news_goes_to_the_plain_sink_as_ids_and_text_alone(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    request = _request(tokenizer, "plain-all", "one two three four five six seven eight nine ten")
    delivered: list[list[int]] = []  # token ids of each delivery, whichever sink took it
    num_plain = 0
    finished: list[GenerateOutput] = []
    declined_plain = 0
    texts: list[str] = []  # of every delivery, in order
    counts: list[int] = []  # num_completion_tokens after each delivery

    def plain(token_ids: list[int], text: str, num_completion_tokens: int) -> bool:
        nonlocal num_plain, declined_plain
        if (num_plain + declined_plain) % 3 == 2:  # some declined: that news must reach `take` instead
            declined_plain += 1
            return False
        num_plain += 1
        delivered.append(list(token_ids))
        texts.append(text)
        counts.append(num_completion_tokens)
        return True

    def take(output: GenerateOutput) -> bool:
        delivered.append(_ids([output]))
        texts.append("".join(chunk.text for chunk in output.chunks))
        counts.append(output.chunks[-1].num_completion_tokens)
        if output.finished:
            finished.append(output)
        return True

    assert await _yielded(fake_engine, request, take, plain) == []
    assert num_plain >= 2
    assert declined_plain >= 1
    assert [token_id for ids in delivered for token_id in ids] == list(request.prompt_token_ids)
    assert len(finished) == 1  # the end is never plain: it reaches the full sink
    assert finished[0].chunks[-1].num_completion_tokens == len(request.prompt_token_ids)
    assert "".join(texts) == tokenizer.decode(list(request.prompt_token_ids))
    assert counts == [len(ids) for ids in itertools.accumulate(delivered)]  # running totals


async def test_a_failing_plain_sink_falls_back_to_the_iterator(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    request = _request(tokenizer, "plain-broken", "the plain sink raises but the stream survives")
    offered: list[GenerateOutput] = []

    def broken(token_ids: list[int], text: str, num_completion_tokens: int) -> bool:
        raise RuntimeError("plain sink bug")

    def take(output: GenerateOutput) -> bool:
        offered.append(output)
        return True

    yielded = await _yielded(fake_engine, request, take, broken)
    # NOTE: both sinks are dropped with the failure: everything from then on comes through the iterator
    assert offered == []
    assert _ids(yielded) == list(request.prompt_token_ids)
    assert yielded[-1].finished


async def test_the_ready_callback_is_called_once_the_stream_needs_a_consumer(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    """A consumer that is not waiting in the iterator (a task-less call) is called back, once, when the sink
    declines; from then on it iterates, and gets everything after what the sink took, in order."""
    request = _request(tokenizer, "ready-cb", "alpha beta gamma delta epsilon zeta eta theta iota kappa")
    delivered: list[GenerateOutput] = []
    num_ready = 0
    ready = asyncio.Event()

    def first_two(output: GenerateOutput) -> bool:
        if len(delivered) >= 2:
            return False
        delivered.append(output)
        return True

    def on_ready() -> None:
        nonlocal num_ready
        num_ready += 1
        ready.set()

    stream = fake_engine.generate(request)
    stream.set_sink(first_two)
    assert stream.set_ready_callback(on_ready)
    async with asyncio.timeout(TIMEOUT):
        await ready.wait()
        async for output in stream:  # the consumer takes over
            delivered.append(output)
    assert num_ready == 1
    assert _ids(delivered) == list(request.prompt_token_ids)
    assert delivered[-1].finished


async def test_a_sink_that_takes_the_end_leaves_the_ready_callback_uncalled_until_cleared(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    request = _request(tokenizer, "ready-end", "one two three four")
    pushed: list[GenerateOutput] = []
    calls: list[str] = []
    stream = fake_engine.generate(request)

    ended = asyncio.Event()

    def take(output: GenerateOutput) -> bool:
        pushed.append(output)
        if output.finished:  # as StreamedGenerate.push ends a task-less call: no consumer is needed
            stream.set_ready_callback(None)
            ended.set()
        return True

    stream.set_sink(take)
    assert stream.set_ready_callback(lambda: calls.append("ready"))
    async with asyncio.timeout(TIMEOUT):
        await ended.wait()
    assert calls == []
    assert _ids(pushed) == list(request.prompt_token_ids)
    # once something is there for a consumer, the callback is refused (iterate instead)
    assert not stream.set_ready_callback(lambda: calls.append("late"))
    stream.close()


async def test_a_failed_request_calls_the_ready_callback(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    request = _request(tokenizer, "ready-fail", "one two three four five six")
    stream = fake_engine.generate(request)
    ready = asyncio.Event()
    stream.set_sink(lambda output: True)
    assert stream.set_ready_callback(ready.set)
    stream._state.fail(RuntimeError("the core went away"))
    async with asyncio.timeout(TIMEOUT):
        await ready.wait()
    with pytest.raises(RuntimeError, match="core went away"):
        async for _ in stream:
            pass
