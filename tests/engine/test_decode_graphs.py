"""The CUDA-graph decode path (engine/decode_graphs.py) on the CPU, without capture: the same static buffers,
padding rows and bucketed forward pass a graph records, run eagerly. Greedy tokens through it equal the
regular path's, with batch sizes between buckets (padding rows) and sequences joining and leaving; steps it
does not fit (prefill chunks, prompt logprobs) take the regular path.

On a GPU (`ENGINE_TEST_DEVICE=cuda`) the engine captures the graphs itself and every engine test runs on
them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_server.engine.decode_graphs import DecodeGraphs
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.scheduler import ScheduledSeq
from engine_server.engine.types import EngineRequest, SamplingParams
from engine_testutil import DEVICE, Collected, engine_config, run

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA the engine captures real graphs")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(engine_config(model_dir, max_num_seqs=8, num_threads=1))


def _with_eager_graphs(engine: LLMEngine) -> list[int]:
    """Gives the engine's runner uncaptured DecodeGraphs; returns the list of the graph-path steps' sizes."""
    runner = engine.runner
    assert runner is not None
    assert runner.decode_kernel is not None  # the CPU kernel: the graphs' decode attention
    graphs = DecodeGraphs(runner.model, kv_caches=runner.kv_caches, kernel=runner.decode_kernel, max_batch=8,
                          max_blocks=-(-engine.model_info.max_model_len // runner.block_size),
                          block_size=runner.block_size, spare_block=runner.spare_block, device=runner.device)
    sizes: list[int] = []
    real_run = graphs.run

    def counting_run(decodes: list[ScheduledSeq]) -> Any:
        sizes.append(len(decodes))
        return real_run(decodes)

    graphs.run = counting_run  # type: ignore[method-assign]
    runner.decode_graphs = graphs
    return sizes


def _requests(tag: str) -> list[EngineRequest]:
    prompts = [[5, 9, 200, 31], list(range(40, 75)), [7] * 18, list(range(300, 317)), [11, 12]]
    return [EngineRequest(f"{tag}{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)]


def _tokens(collected: Collected, tag: str) -> list[list[int]]:
    return [collected.tokens[(f"{tag}{i}", 0)] for i in range(5)]


def test_graph_path_gives_the_regular_path_tokens(model_dir: Path) -> None:
    regular = _tokens(run(_engine(model_dir), _requests("a"), per_step=1), "a")
    engine = _engine(model_dir)
    sizes = _with_eager_graphs(engine)
    graphed = _tokens(run(engine, _requests("a"), per_step=1), "a")
    assert graphed == regular
    assert all(len(tokens) == 12 for tokens in graphed)
    # the graph path served steps of several sizes, some between buckets (3, 5: padding rows)
    assert {3, 5} <= set(sizes)
    assert len(sizes) >= 8


def test_steps_the_graphs_do_not_fit_run_eagerly(model_dir: Path) -> None:
    engine = _engine(model_dir)
    sizes = _with_eager_graphs(engine)
    engine.add_request(EngineRequest("p0", tuple(range(20, 60)), GREEDY))
    engine.step()  # the prompt's prefill
    assert sizes == []
    engine.add_request(EngineRequest("p1", tuple(range(60, 70)),
                                     SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1)))
    engine.step()  # a decode and a prefill in one step
    assert sizes == []
    engine.step()  # two decodes
    assert sizes == [2]
