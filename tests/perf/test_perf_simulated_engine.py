"""The simulated engine core behind the real process boundary (the frontend benchmark's engine)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from engine_server.engine.config import EngineConfig
from engine_server.engine.simulated import simulated_engine_factory
from engine_server.engine.types import FinishReason, SamplingParams
from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.outputs import GenerateRequest

TIMEOUT = 60.0


async def test_streams_max_tokens_and_aborts_cleanly(tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir), max_num_seqs=4)
    async with asyncio.timeout(TIMEOUT):
        engine = await AsyncEngine.start(config, engine_factory=simulated_engine_factory(2.0))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, n=2)
            outputs = [o async for o in engine.generate(GenerateRequest("a", (20, 21, 22), params))]
            for index in (0, 1):
                chunks = [c for o in outputs for c in o.chunks if c.index == index]
                assert sum(len(c.token_ids) for c in chunks) == 7
                assert chunks[-1].finish_reason is FinishReason.LENGTH
                assert all(t >= 16 for c in chunks for t in c.token_ids)  # ordinary ids only
            assert outputs[-1].finished
            assert outputs[0].num_prompt_tokens == 3

            # Endless requests (6 more than fit the batch wait), then aborts: nothing left running.
            endless = SamplingParams(max_tokens=2000, ignore_eos=True)
            streams = [engine.generate(GenerateRequest(f"e{i}", (30,), endless)) for i in range(10)]
            first = await streams[0].__anext__()
            assert first.chunks[0].token_ids
            assert await engine.abort(["e0", "e9"]) == ["e0", "e9"]
            for stream in streams[1:9]:
                await stream.aclose()
            with contextlib.suppress(StopAsyncIteration):
                while True:
                    await streams[9].__anext__()
            stats = await engine.wait_idle()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
        finally:
            await engine.shutdown(timeout=5.0)


def test_one_completion_aborts_alone(tiny_model_dir: Path) -> None:
    from engine_server.engine.simulated import SimulatedEngine
    from engine_server.engine.types import EngineRequest

    engine = SimulatedEngine(EngineConfig(model=str(tiny_model_dir)), step_s=0.0)
    engine.add_request(EngineRequest("n3", (20, 21), SamplingParams(max_tokens=5, ignore_eos=True, n=3)))
    assert len(engine.step()) == 3
    assert engine.abort_completions([("n3", 1), ("n3", 7), ("other", 0)]) == [("n3", 1)]
    deltas = engine.step()
    aborted = [d for d in deltas if d.finish_reason is FinishReason.ABORT]
    assert [(d.index, d.new_token_ids) for d in aborted] == [(1, [])]
    tokens = {0: 1, 2: 1}
    while engine.has_unfinished():
        for d in engine.step() + deltas:
            tokens[d.index] = tokens.get(d.index, 0) + len(d.new_token_ids)
        deltas = []
    assert tokens == {0: 5, 1: 0, 2: 5}
