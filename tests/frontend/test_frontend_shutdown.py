"""A clean shutdown of the real engine (own or shared core process) is quick; the core exits by itself."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from engine_server.engine.config import EngineConfig
from engine_server.engine.types import SamplingParams
from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.outputs import GenerateRequest
from engine_server.frontend.scale_out import start_shared_core

# NOTE: before the core skipped the interpreter's teardown, this took 1.05-2.0 s on an idle 2-core machine
# (and reached CoreClient.close's 5 s kill on a busy one); now ~0.05 s. The bound leaves room for load.
SHUTDOWN_BUDGET_S = 0.75


async def _own_core(config: EngineConfig) -> AsyncEngine:
    return await AsyncEngine.start(config, in_process=False)


async def _shared_core(config: EngineConfig) -> AsyncEngine:
    engine, other_pipes = await start_shared_core(config, num_frontends=1)  # `--api-workers`' core
    assert other_pipes == []
    return engine


@pytest.mark.parametrize("start", [_own_core, _shared_core], ids=["own-core", "shared-core"])
async def test_idle_engine_shuts_down_fast_and_core_exits_cleanly(
    model_dir: Path, start: Callable[[EngineConfig], Awaitable[AsyncEngine]]
) -> None:
    config = EngineConfig(model=str(model_dir), max_num_seqs=4, num_kv_blocks=64, block_size=4)
    engine = await start(config)
    core_pid = engine.core_pid
    assert core_pid is not None
    process = engine._client._process  # the exit code is only visible to the parent's Process object
    assert process is not None
    assert Path(f"/proc/{core_pid}/comm").read_text() == "engine-core\n"  # named: see proc_title.py
    if "OMP_WAIT_POLICY" not in os.environ:  # the core's defaults apply to the shared core too
        assert b"OMP_WAIT_POLICY=PASSIVE" in Path(f"/proc/{core_pid}/environ").read_bytes().split(b"\0")
    try:
        # One request first: torch has run (its OpenMP pool exists), as in a real server's shutdown.
        prompt = tuple(engine.tokenizer.encode("Hello").token_ids)
        params = SamplingParams(temperature=0.0, max_tokens=4)
        token_ids = [i async for output in engine.generate(GenerateRequest("warm", prompt, params))
                     for chunk in output.chunks for i in chunk.token_ids]
        assert len(token_ids) == 4
    except BaseException:
        await engine.shutdown(timeout=5.0)
        raise
    started = time.monotonic()
    await engine.shutdown(timeout=5.0)
    elapsed = time.monotonic() - started
    assert process.exitcode == 0  # exited by itself: a killed core reads -9
    assert not os.path.exists(f"/proc/{core_pid}")
    assert elapsed < SHUTDOWN_BUDGET_S, f"shutdown took {elapsed:.2f} s"

