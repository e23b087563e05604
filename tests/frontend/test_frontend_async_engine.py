"""AsyncEngine on the fake echo core, in process: streaming, coalescing, stop strings, cancels, errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from engine_server.core.messages import AbortElsewhereCommand
from engine_server.engine.config import EngineConfig
from engine_server.engine.types import (
    EngineDead,
    EngineOverloaded,
    FinishReason,
    RequestError,
    SamplingParams,
)
from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.outputs import EngineState, GenerateOutput, GenerateRequest
from engine_server.frontend.tokenizer import Tokenizer
from fake_core import EOS_ID, NUM_BLOCKS, FakeCore, fake_config, fake_factory, fake_validate

TIMEOUT = 10.0


def _request(
    tokenizer: Tokenizer, request_id: str, text: str, *, max_tokens: int | None = None, n: int = 1,
    stop: tuple[str, ...] = (), include_stop: bool = False, extra_ids: tuple[int, ...] = (),
) -> GenerateRequest:
    ids = (*tokenizer.encode(text, add_special_tokens=False).token_ids, *extra_ids)
    params = SamplingParams(n=n, max_tokens=max_tokens if max_tokens is not None else len(ids))
    return GenerateRequest(request_id, ids, params, stop=stop, include_stop_str_in_output=include_stop)


async def _collect(engine: AsyncEngine, request: GenerateRequest) -> list[GenerateOutput]:
    async with asyncio.timeout(TIMEOUT):
        return [output async for output in engine.generate(request)]


def _text(outputs: list[GenerateOutput], index: int = 0) -> str:
    return "".join(chunk.text for output in outputs for chunk in output.chunks if chunk.index == index)


def _ids(outputs: list[GenerateOutput], index: int = 0) -> list[int]:
    chunks = [chunk for output in outputs for chunk in output.chunks if chunk.index == index]
    return [token_id for chunk in chunks for token_id in chunk.token_ids]


async def _assert_all_free(engine: AsyncEngine) -> None:
    async with asyncio.timeout(TIMEOUT):
        stats = await engine.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, NUM_BLOCKS)
    assert engine.num_in_flight == engine.num_running == engine.num_waiting == 0


async def test_streams_echo_in_order_with_exact_text(fake_engine: AsyncEngine, tokenizer: Tokenizer) -> None:
    text = "Hello 你好 🎉 world"
    request = _request(tokenizer, "r1", text)
    outputs = await _collect(fake_engine, request)
    assert _ids(outputs) == list(request.prompt_token_ids)
    assert _text(outputs) == text
    last = outputs[-1]
    assert last.finished
    assert last.chunks[-1].finish_reason is FinishReason.LENGTH
    assert last.chunks[-1].num_completion_tokens == len(request.prompt_token_ids)
    assert all(not output.finished for output in outputs[:-1])
    assert last.num_prompt_tokens == len(request.prompt_token_ids)
    await _assert_all_free(fake_engine)


async def test_slow_consumer_gets_one_coalesced_output(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    request = _request(tokenizer, "slow", "one two three four five six", max_tokens=40)
    stream = fake_engine.generate(request)
    await fake_engine.wait_idle()  # the engine finished all 40 steps before the consumer looked once
    outputs = [output async for output in stream]
    assert len(outputs) == 1
    assert len(outputs[0].chunks) == 1
    chunk = outputs[0].chunks[0]
    assert len(chunk.token_ids) == chunk.num_completion_tokens == 40
    assert chunk.text == tokenizer.decode(chunk.token_ids)
    assert outputs[0].finished


async def test_n_completions_are_interleaved_by_index(fake_engine: AsyncEngine, tokenizer: Tokenizer) -> None:
    request = _request(tokenizer, "multi", "abc def", n=3)
    outputs = await _collect(fake_engine, request)
    for output in outputs:
        assert [chunk.index for chunk in output.chunks] == sorted(chunk.index for chunk in output.chunks)
    for index in range(3):
        assert _text(outputs, index) == "abc def"
    finals = [chunk for output in outputs for chunk in output.chunks if chunk.finish_reason is not None]
    assert sorted(chunk.index for chunk in finals) == [0, 1, 2]
    assert outputs[-1].finished


@pytest.mark.parametrize(("include", "expected"), [(False, "abc "), (True, "abc STOP")])
async def test_stop_string_across_tokens_truncates_and_frees_blocks(
    fake_engine: AsyncEngine, tokenizer: Tokenizer, include: bool, expected: str
) -> None:
    # " S" "T" "O" "P" are separate tokens: the match completes on the fourth one.
    request = _request(tokenizer, "stop", "abc STOP def", max_tokens=200, stop=("STOP", "xyz"),
                       include_stop=include)
    outputs = await _collect(fake_engine, request)
    assert _text(outputs) == expected
    final = outputs[-1].chunks[-1]
    assert (final.finish_reason, final.stop_reason) == (FinishReason.STOP, "STOP")
    assert tokenizer.decode(_ids(outputs)) == "abc STOP"  # ids end at the token that completed the match
    await _assert_all_free(fake_engine)  # the engine was told to abort: 200 tokens were never generated


async def test_stop_string_held_back_then_released(fake_engine: AsyncEngine, tokenizer: Tokenizer) -> None:
    request = _request(tokenizer, "partial", "abc STOP", stop=("STOPPED",))
    outputs = await _collect(fake_engine, request)
    assert _text(outputs) == "abc STOP"  # a partial match is released when the completion ends
    assert outputs[-1].chunks[-1].finish_reason is FinishReason.LENGTH


async def test_eos_finishes_with_the_token_id(fake_engine: AsyncEngine, tokenizer: Tokenizer) -> None:
    request = _request(tokenizer, "eos", "abc", max_tokens=50, extra_ids=(EOS_ID,))
    outputs = await _collect(fake_engine, request)
    final = outputs[-1].chunks[-1]
    assert (final.finish_reason, final.stop_reason) == (FinishReason.STOP, EOS_ID)
    assert _text(outputs) == "abc"  # EOS is a special token: skipped in text


async def test_no_detokenize_gives_ids_only(fake_engine: AsyncEngine, tokenizer: Tokenizer) -> None:
    base = _request(tokenizer, "ids", "abc def")
    request = GenerateRequest("ids", base.prompt_token_ids, base.params, detokenize=False)
    outputs = await _collect(fake_engine, request)
    assert _text(outputs) == ""
    assert _ids(outputs) == list(base.prompt_token_ids)


async def test_stop_string_without_detokenize_still_cuts_the_ids(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    base = _request(tokenizer, "ids-stop", "abc STOP def", max_tokens=100)
    request = GenerateRequest(
        "ids-stop", base.prompt_token_ids, base.params, stop=("STOP",), detokenize=False
    )
    outputs = await _collect(fake_engine, request)
    assert _text(outputs) == ""
    assert tokenizer.decode(_ids(outputs)) == "abc STOP"
    assert outputs[-1].chunks[-1].stop_reason == "STOP"


async def test_a_completion_ending_on_a_stop_string_stops_its_sequence_only(
    model_dir: Path, tokenizer: Tokenizer
) -> None:
    cores: list[FakeCore] = []

    def factory(config: EngineConfig) -> FakeCore:
        cores.append(FakeCore(config, vocab_size=tokenizer.vocab_size, step_delay=0.001))
        return cores[-1]

    engine = await AsyncEngine.start(fake_config(model_dir), in_process=True, engine_factory=factory,
                                     validator=fake_validate)
    try:
        # "gate": completions 1 and 2 run only once the core has dropped completion 0, which never ends on
        # its own; they echo the prompt from tokens 1 and 2 on, so "STOP" (tokens 0-3) is never theirs.
        text = "STOP and then more words"
        prompt = tokenizer.encode(text, add_special_tokens=False).token_ids
        request = _request(tokenizer, "gate-1", text, n=3, max_tokens=len(prompt) - 2, stop=("STOP",))
        outputs = await _collect(engine, request)
        final = {chunk.index: chunk for output in outputs for chunk in output.chunks if chunk.finish_reason}
        assert (final[0].finish_reason, final[0].stop_reason) == (FinishReason.STOP, "STOP")
        assert (_text(outputs, 0), tokenizer.decode(_ids(outputs, 0))) == ("", "STOP")
        for index in (1, 2):
            assert _ids(outputs, index) == prompt[index:index + len(prompt) - 2]
            assert (final[index].finish_reason, final[index].num_completion_tokens) == (
                FinishReason.LENGTH, len(prompt) - 2)
        assert cores[0].aborted_completions == [("gate-1", 0)]  # that completion only, not the request
        await _assert_all_free(engine)
    finally:
        await engine.shutdown(timeout=5.0)


async def test_cancelled_consumers_abort_in_the_engine(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    first_outputs: list[asyncio.Event] = []

    async def consume(request_id: str) -> None:
        got_one = asyncio.Event()
        first_outputs.append(got_one)
        async for _ in fake_engine.generate(_request(tokenizer, request_id, "abc", max_tokens=200)):
            got_one.set()

    tasks = [asyncio.create_task(consume(f"hold-c{i}")) for i in range(12)]  # 8 run, 4 wait
    async with asyncio.timeout(TIMEOUT):
        await asyncio.gather(*(event.wait() for event in first_outputs[:4]))
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(result, asyncio.CancelledError) for result in results)
    await _assert_all_free(fake_engine)


async def test_aclose_and_dropped_streams_abort(fake_engine: AsyncEngine, tokenizer: Tokenizer) -> None:
    stream = fake_engine.generate(_request(tokenizer, "hold-closed", "abc", max_tokens=200))
    await anext(stream)
    await stream.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    fake_engine.generate(_request(tokenizer, "hold-dropped", "abc", max_tokens=200))  # never iterated
    await _assert_all_free(fake_engine)


async def test_abort_ends_streams_with_abort(fake_engine: AsyncEngine, tokenizer: Tokenizer) -> None:
    stream = fake_engine.generate(_request(tokenizer, "hold-victim", "abc", max_tokens=200))
    await anext(stream)
    assert await fake_engine.abort(["hold-victim", "unknown-id"]) == ["hold-victim"]
    rest = [output async for output in stream]
    assert rest[-1].finished
    assert rest[-1].chunks[-1].finish_reason is FinishReason.ABORT
    assert await fake_engine.abort(["hold-victim"]) == []
    await _assert_all_free(fake_engine)


async def test_duplicate_and_invalid_requests_fail_synchronously(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    stream = fake_engine.generate(_request(tokenizer, "dup", "abc", max_tokens=100))
    with pytest.raises(RequestError) as excinfo:
        fake_engine.generate(_request(tokenizer, "dup", "abc"))
    assert excinfo.value.field_name == "request_id"
    with pytest.raises(RequestError) as excinfo:
        fake_engine.generate(GenerateRequest("oov", (5, tokenizer.vocab_size + 7)))
    assert excinfo.value.field_name == "prompt_token_ids[1]"
    outputs = [output async for output in stream]  # the others keep going
    assert len(_ids(outputs)) == 100


async def test_core_rejection_reaches_that_request_only(model_dir: Path, tokenizer: Tokenizer) -> None:
    engine = await AsyncEngine.start(
        fake_config(model_dir), in_process=True, engine_factory=fake_factory(tokenizer.vocab_size),
        validator=lambda request, info: None,  # let a bad request through to the core
    )
    try:
        good = engine.generate(_request(tokenizer, "good", "abc def"))
        bad = engine.generate(GenerateRequest("bad", (tokenizer.vocab_size + 1,)))
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await anext(bad)
        outputs = [output async for output in good]
        assert _text(outputs) == "abc def"
        assert engine.state is EngineState.SERVING
    finally:
        await engine.shutdown(timeout=5.0)


async def test_a_core_bug_in_admission_fails_that_request_only(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    good = fake_engine.generate(_request(tokenizer, "fine", "abc def"))
    with pytest.raises(RuntimeError, match="injected add_request bug"):
        await anext(fake_engine.generate(_request(tokenizer, "boom-1", "abc")))
    assert _text([output async for output in good]) == "abc def"
    assert fake_engine.state is EngineState.SERVING


async def test_overload_is_refused(model_dir: Path, tokenizer: Tokenizer) -> None:
    engine = await AsyncEngine.start(
        fake_config(model_dir), in_process=True, engine_factory=fake_factory(tokenizer.vocab_size),
        validator=fake_validate, max_pending=3,
    )
    try:
        streams = [engine.generate(_request(tokenizer, f"o{i}", "abc")) for i in range(3)]
        with pytest.raises(EngineOverloaded):
            engine.generate(_request(tokenizer, "o3", "abc"))
        for stream in streams:
            assert _text([output async for output in stream]) == "abc"
        await engine.wait_idle()
        engine.generate(_request(tokenizer, "o3", "abc"))  # room again once they finished
    finally:
        await engine.shutdown(timeout=5.0)


async def test_core_failure_ends_every_stream(fake_engine: AsyncEngine, tokenizer: Tokenizer) -> None:
    requests = [_request(tokenizer, f"hold-v{i}", "abc", max_tokens=20) for i in range(5)]
    streams = [fake_engine.generate(request) for request in requests]
    changes: list[EngineState] = []
    fake_engine.add_state_listener(changes.append)
    for stream in streams:
        await anext(stream)
    fake_engine.generate(_request(tokenizer, "crash-now", "abc"))  # the fake core raises on its next step
    async with asyncio.timeout(TIMEOUT):
        for stream in streams:
            with pytest.raises(EngineDead, match="injected engine failure"):
                async for _ in stream:
                    pass
    assert fake_engine.state is EngineState.FAILED
    assert changes == [EngineState.FAILED]
    with pytest.raises(EngineDead):
        fake_engine.generate(_request(tokenizer, "late", "abc"))
    with pytest.raises(EngineDead):
        await fake_engine.embed([[1, 2]], normalize=False)


async def test_a_failed_request_reports_its_error_and_others_go_on(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    good = fake_engine.generate(_request(tokenizer, "fine", "abc def"))
    outputs = await _collect(fake_engine, _request(tokenizer, "fail-1", "abc", n=2))
    assert outputs[-1].finished
    assert outputs[-1].error == "injected request failure"
    assert {chunk.finish_reason for output in outputs for chunk in output.chunks} == {FinishReason.ERROR}
    assert _text([output async for output in good]) == "abc def"
    assert fake_engine.state is EngineState.SERVING
    await _assert_all_free(fake_engine)


async def test_embed_round_trip(fake_engine: AsyncEngine) -> None:
    vectors = await fake_engine.embed([[3, 4], [5]], normalize=False)
    assert vectors == [[2.0, 7.0, 1.0, 0.0], [1.0, 5.0, 1.0, 0.0]]
    with pytest.raises(RequestError, match="inputs"):
        await fake_engine.embed([[]], normalize=True)


async def test_a_single_core_answers_abort_elsewhere_and_keeps_serving(
    fake_engine: AsyncEngine, tokenizer: Tokenizer,
) -> None:
    # NOTE: only a shared-core handle sends this command; a single-frontend core must answer "none found"
    # rather than take an unknown command for a shutdown.
    async with asyncio.timeout(TIMEOUT):
        found = await fake_engine._call(lambda call_id: AbortElsewhereCommand(call_id, ("nobody",)))
    assert found == []
    assert _text(await _collect(fake_engine, _request(tokenizer, "after", "still here"))) == "still here"


async def test_drain_refuses_new_requests_and_shutdown_aborts_the_rest(
    fake_engine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    short = fake_engine.generate(_request(tokenizer, "short", "abc"))
    endless = fake_engine.generate(_request(tokenizer, "hold-long", "abc", max_tokens=200))
    await anext(endless)
    fake_engine.begin_drain()
    assert fake_engine.state.name == "DRAINING"  # NOTE: no `is`: mypy would narrow the attribute for good
    with pytest.raises(EngineDead):
        fake_engine.generate(_request(tokenizer, "new", "abc"))
    assert _text([output async for output in short]) == "abc"
    # Shutdown waits for the drain budget, then aborts what is left.
    await fake_engine.shutdown(timeout=0.05)
    assert fake_engine.state is EngineState.STOPPED
    rest = [output async for output in endless]
    assert rest[-1].chunks[-1].finish_reason is FinishReason.ABORT
