"""AsyncEngine on the real LLMEngine (tiny random model, CPU): in-process and in its own process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
import pytest_asyncio
from engine_server.engine.config import EngineConfig
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineDead, EngineStats, FinishReason, SamplingParams
from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.core_process import EngineLoadError
from engine_server.frontend.outputs import EngineState, GenerateOutput, GenerateRequest

pytestmark = pytest.mark.asyncio(loop_scope="module")

TIMEOUT = 60.0
PROMPTS = ("Hello world", "你好\uff0c世界 🎉", "The quick brown fox", "a", "Once upon a time there was",
           "1 2 3 4")


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), max_num_seqs=16, num_kv_blocks=128, block_size=4)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(model_dir: Path) -> AsyncIterator[AsyncEngine]:
    engine = await AsyncEngine.start(_config(model_dir), in_process=True)
    yield engine
    await engine.shutdown(timeout=10.0)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[tuple[str, int], list[int]]:
    """Greedy continuations from transformers' own `generate`, one prompt at a time."""
    # NOTE: on a worker thread: torch ops from the main thread spin in OpenMP (see core_process.py) and
    # run many times slower on a busy machine.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_reference, model_dir).result()


def _reference(model_dir: Path) -> dict[tuple[str, int], list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)  # in eval mode
    result = {}
    for prompt in PROMPTS:
        for max_tokens in (1, 9, 24):
            input_ids = torch.tensor([hf_tokenizer(prompt).input_ids])
            with torch.no_grad():
                out = model.generate(input_ids, do_sample=False, max_new_tokens=max_tokens,
                                     attention_mask=torch.ones_like(input_ids))
            result[(prompt, max_tokens)] = out[0, input_ids.shape[1]:].tolist()
    return result


def _greedy(
    engine: AsyncEngine, request_id: str, prompt: str, max_tokens: int, **kwargs: object
) -> GenerateRequest:
    ids = tuple(engine.tokenizer.encode(prompt).token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return GenerateRequest(request_id, ids, params, **kwargs)  # type: ignore[arg-type]


async def _collect(engine: AsyncEngine, request: GenerateRequest) -> list[GenerateOutput]:
    async with asyncio.timeout(TIMEOUT):
        return [output async for output in engine.generate(request)]


def _ids(outputs: list[GenerateOutput]) -> list[int]:
    return [token_id for output in outputs for chunk in output.chunks for token_id in chunk.token_ids]


def _text(outputs: list[GenerateOutput]) -> str:
    return "".join(chunk.text for output in outputs for chunk in output.chunks)


def _completion_text(outputs: list[GenerateOutput], index: int) -> str:
    return "".join(chunk.text for output in outputs for chunk in output.chunks if chunk.index == index)


async def _assert_idle_and_free(engine: AsyncEngine) -> None:
    async with asyncio.timeout(TIMEOUT):
        stats = await engine.wait_idle()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert engine.num_in_flight == 0


async def _concurrent_greedy(engine: AsyncEngine, tag: str) -> dict[tuple[str, int], list[GenerateOutput]]:
    rng = random.Random(5)
    cases = [(prompt, max_tokens) for prompt in PROMPTS for max_tokens in (1, 9, 24)]

    async def one(case: tuple[str, int], number: int) -> list[GenerateOutput]:
        for _ in range(rng.randint(0, 3)):  # staggered arrivals: join while others run
            await asyncio.sleep(0)
        return await _collect(engine, _greedy(engine, f"{tag}-{number}", *case))

    results = await asyncio.gather(*(one(case, number) for number, case in enumerate(cases)))
    return dict(zip(cases, results, strict=True))


async def test_concurrent_greedy_matches_transformers(
    engine: AsyncEngine, reference: dict[tuple[str, int], list[int]]
) -> None:
    results = await _concurrent_greedy(engine, "greedy")
    for case, outputs in results.items():
        assert _ids(outputs) == reference[case], case
        assert _text(outputs) == engine.tokenizer.decode(_ids(outputs)), case
        final = outputs[-1].chunks[-1]
        assert outputs[-1].finished
        assert final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    await _assert_idle_and_free(engine)


async def test_sampled_text_is_exactly_the_full_decode(engine: AsyncEngine) -> None:
    ids = tuple(engine.tokenizer.encode("你好 🎉").token_ids)
    request = GenerateRequest("sampled", ids, SamplingParams(n=3, temperature=1.5, seed=11, max_tokens=40,
                                                             ignore_eos=True))
    outputs = await _collect(engine, request)
    for index in range(3):
        chunks = [chunk for output in outputs for chunk in output.chunks if chunk.index == index]
        token_ids = [token_id for chunk in chunks for token_id in chunk.token_ids]
        assert len(token_ids) == chunks[-1].num_completion_tokens == 40
        assert "".join(chunk.text for chunk in chunks) == engine.tokenizer.decode(token_ids)


class _RecordingEngine(LLMEngine):
    """Records the completions the core loop asks it to abort (and which were live)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.aborted_completions: list[tuple[str, int]] = []

    def abort_completions(self, completions: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        found = super().abort_completions(completions)
        self.aborted_completions.extend(found)
        return found


async def test_one_completion_ending_on_a_stop_string_is_aborted_in_the_engine(model_dir: Path) -> None:
    cores: list[_RecordingEngine] = []

    def factory(config: EngineConfig) -> _RecordingEngine:
        cores.append(_RecordingEngine(config))
        return cores[-1]

    engine = await AsyncEngine.start(_config(model_dir), in_process=True, engine_factory=factory)
    try:
        ids = tuple(engine.tokenizer.encode("Once upon a time").token_ids)
        # NOTE: many tokens, so that the engine cannot finish completion 0 before the abort reaches it
        params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=160, ignore_eos=True)
        full = await _collect(engine, GenerateRequest("full", ids, params))
        texts = [_completion_text(full, index) for index in range(3)]
        # a piece of completion 0's text early on that the others never produce
        stop = next(piece for piece in (texts[0][p:p + 4] for p in range(2, 20))
                    if all(piece not in text for text in texts[1:]))
        outputs = await _collect(engine, GenerateRequest("stop", ids, params, stop=(stop,)))
        finals = {chunk.index: chunk for output in outputs for chunk in output.chunks if chunk.finish_reason}
        assert _completion_text(outputs, 0) == texts[0][:texts[0].find(stop)]
        assert (finals[0].finish_reason, finals[0].stop_reason) == (FinishReason.STOP, stop)
        for index in (1, 2):
            assert (finals[index].finish_reason, finals[index].num_completion_tokens) == (
                FinishReason.LENGTH, 160)
        assert cores[0].aborted_completions == [("stop", 0)]  # live in the engine when asked: stopped early
        await _assert_idle_and_free(engine)
    finally:
        await engine.shutdown(timeout=10.0)


async def test_logprobs_ride_with_their_tokens(engine: AsyncEngine) -> None:
    ids = tuple(engine.tokenizer.encode("The quick brown fox").token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, prompt_logprobs=1)
    outputs = await _collect(engine, GenerateRequest("logprobs", ids, params))
    assert outputs[0].prompt_logprobs is not None
    assert len(outputs[0].prompt_logprobs) == len(ids)
    assert all(output.prompt_logprobs is None for output in outputs[1:])
    for output in outputs:
        for chunk in output.chunks:
            assert chunk.logprobs is not None
            assert [logprob.token_id for logprob in chunk.logprobs] == chunk.token_ids
            assert all(len(logprob.top) == 2 for logprob in chunk.logprobs)


async def test_stop_string_on_real_output(engine: AsyncEngine) -> None:
    full = await _collect(engine, _greedy(engine, "nostop", "Once upon a time there was", 24))
    text = _text(full)
    assert len(text) > 12
    stop = text[8:12]  # somewhere inside the output, usually spanning a token boundary
    outputs = await _collect(engine, _greedy(engine, "stop", "Once upon a time there was", 24, stop=(stop,)))
    assert _text(outputs) == text[: text.find(stop)]
    final = outputs[-1].chunks[-1]
    assert (final.finish_reason, final.stop_reason) == (FinishReason.STOP, stop)
    await _assert_idle_and_free(engine)


async def test_random_cancellations_leave_no_running_request_and_free_blocks(engine: AsyncEngine) -> None:
    rng = random.Random(3)

    async def consume(number: int, cancel_after: int) -> None:
        request = _greedy(engine, f"cancel-{number}", rng.choice(PROMPTS), 200)
        seen = 0
        async for _ in engine.generate(request):
            seen += 1
            if seen >= cancel_after:
                raise asyncio.CancelledError  # as if the client went away

    tasks = [asyncio.create_task(consume(number, rng.randint(1, 6))) for number in range(40)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(result, asyncio.CancelledError) for result in results)
    await _assert_idle_and_free(engine)


async def test_own_process_serves_then_fails_fast_when_killed(
    model_dir: Path, reference: dict[tuple[str, int], list[int]]
) -> None:
    engine = await AsyncEngine.start(_config(model_dir), in_process=False)
    try:
        assert engine.core_pid is not None
        core_environment = Path(f"/proc/{engine.core_pid}/environ").read_bytes().split(b"\0")
        if "OMP_WAIT_POLICY" not in os.environ:  # set for the core only, not left in the server's environment
            assert b"OMP_WAIT_POLICY=PASSIVE" in core_environment
        results = await _concurrent_greedy(engine, "proc")
        for case, outputs in results.items():
            assert _ids(outputs) == reference[case], case
        await _assert_idle_and_free(engine)
        endless = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        ids = tuple(engine.tokenizer.encode("Hello").token_ids)
        streams = [engine.generate(GenerateRequest(f"doomed-{i}", ids, endless)) for i in range(6)]
        for stream in streams:
            await anext(stream)
        core_pid = engine.core_pid
        engine.kill_core()
        async with asyncio.timeout(10.0):
            for stream in streams:
                with pytest.raises(EngineDead, match="exited"):
                    async for _ in stream:
                        pass
            # The dead core is collected at once (no zombie while the server lives on), and the load is
            # nothing, not the last step's.
            while Path(f"/proc/{core_pid}").exists():  # noqa: ASYNC110 - another process: bounded above
                await asyncio.sleep(0.01)
        assert engine.state is EngineState.FAILED
        assert engine.stats() == EngineStats(num_running=0, num_waiting=0, num_free_blocks=0,
                                             num_total_blocks=0)
        with pytest.raises(EngineDead):
            engine.generate(_greedy(engine, "after", "Hello", 4))
    finally:
        await engine.shutdown(timeout=5.0)


@pytest.mark.parametrize("in_process", [True, False])
async def test_a_missing_model_is_a_clear_error_at_once(tmp_path: Path, in_process: bool) -> None:
    with pytest.raises(EngineLoadError, match="does not exist"):
        await AsyncEngine.start(EngineConfig(model=str(tmp_path / "missing")), in_process=in_process)


@pytest.mark.parametrize("in_process", [True, False])
async def test_a_load_failure_in_the_core_reaches_the_caller(tmp_path: Path, in_process: bool) -> None:
    from failing_core import failing_factory

    with pytest.raises(EngineLoadError, match=r"FileNotFoundError: .* has no config.json"):
        await AsyncEngine.start(EngineConfig(model=str(tmp_path)), in_process=in_process,
                                engine_factory=failing_factory)  # type: ignore[arg-type]


async def test_an_incomplete_model_directory_is_reported_by_the_loader(tmp_path: Path) -> None:
    with pytest.raises(EngineLoadError, match=r"no config\.json"):
        await AsyncEngine.start(EngineConfig(model=str(tmp_path)), in_process=True)
