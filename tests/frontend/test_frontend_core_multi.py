"""The shared engine core (--api-workers): admission bugs fail one request only; per-completion aborts; an
Abort on one frontend ends a request that another frontend runs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from engine_server.core.loop import CoreLoop
from engine_server.core.messages import (
    AbortCommand,
    AbortCompletionsCommand,
    AbortElsewhereCommand,
    AddCommand,
    CallReply,
    ShutdownCommand,
    StepOutput,
)
from engine_server.engine.config import EngineConfig
from engine_server.engine.types import EngineDead, EngineRequest, FinishReason, SamplingParams
from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.outputs import GenerateOutput, GenerateRequest
from engine_server.frontend.scale_out import attach_engine, start_shared_core
from engine_server.frontend.tokenizer import Tokenizer
from fake_core import NUM_BLOCKS, FakeCore, fake_config, fake_factory

TIMEOUT_S = 60.0  # a spawned core on two busy cores


class _AdmissionBugEngine(FakeCore):
    """Raises an unexpected error (not a RequestError) when admitting ids containing "bug"."""

    def add_request(self, request: EngineRequest) -> None:
        if "bug" in request.request_id:
            raise RuntimeError("core bug while admitting")
        super().add_request(request)


def _recv_until(
    conn: Connection, predicate: Callable[[StepOutput], bool], *, timeout: float = 10.0
) -> StepOutput:
    while conn.poll(timeout):
        message = conn.recv()
        if isinstance(message, StepOutput) and predicate(message):
            return message
    raise AssertionError("no matching StepOutput before the timeout")


def _recv_reply(conn: Connection, call_id: int, *, timeout: float = 10.0) -> CallReply:
    while conn.poll(timeout):
        message = conn.recv()
        if isinstance(message, CallReply) and message.call_id == call_id:
            return message
    raise AssertionError(f"no reply to call {call_id} before the timeout")


def _finishes(conn: Connection, request_id: str) -> list[FinishReason]:
    def ends(out: StepOutput) -> bool:
        return any(d.request_id == request_id and d.finish_reason for d in out.deltas)

    out = _recv_until(conn, ends)
    return [d.finish_reason for d in out.deltas if d.request_id == request_id and d.finish_reason]


def test_unexpected_admission_error_rejects_only_that_request(tmp_path: object) -> None:
    engine = _AdmissionBugEngine(fake_config(tmp_path), vocab_size=64)
    frontend, core = Pipe()
    loop = CoreLoop(engine, [core])
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    frontend.send((AddCommand(EngineRequest("bug-1", (5, 6, 7), params)),
                   AddCommand(EngineRequest("ok-1", (5, 6, 7), params))))
    rejected = _recv_until(frontend, lambda out: bool(out.rejected))
    assert [request_id for request_id, _ in rejected.rejected] == ["bug-1"]
    assert "core bug" in rejected.rejected[0][1].message
    # The core lives on and finishes the healthy request.
    _recv_until(frontend, lambda out: any(d.request_id == "ok-1" and d.finish_reason for d in out.deltas))
    assert runner.is_alive()
    frontend.send((ShutdownCommand(),))
    runner.join(timeout=10)
    assert not runner.is_alive()


def test_a_single_completion_is_aborted_under_the_frontends_prefix(tmp_path: object) -> None:
    engine = FakeCore(fake_config(tmp_path), vocab_size=64)
    (primary, primary_core), (worker, worker_core) = Pipe(), Pipe()
    loop = CoreLoop(engine, [primary_core, worker_core])
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    # "gate": completions 1 and 2 run only after the core has dropped completion 0, which never ends alone
    params = SamplingParams(n=3, max_tokens=4, ignore_eos=True)
    worker.send((AddCommand(EngineRequest("gate-1", (5, 6, 7, 8, 9), params)),))
    _recv_until(worker, lambda out: any(d.request_id == "gate-1" and d.index == 0 for d in out.deltas))
    worker.send((AbortCompletionsCommand((("gate-1", 0),)),))
    finishes: dict[int, FinishReason] = {}
    while len(finishes) < 3:
        out = _recv_until(worker, lambda out: any(d.finish_reason for d in out.deltas))
        finishes.update({d.index: d.finish_reason for d in out.deltas if d.finish_reason})
        assert all(d.request_id == "gate-1" for d in out.deltas)  # the worker's prefix is stripped
    assert finishes == {0: FinishReason.ABORT, 1: FinishReason.LENGTH, 2: FinishReason.LENGTH}
    assert engine.aborted_completions == [("1/gate-1", 0)]
    assert engine.stats().num_free_blocks == NUM_BLOCKS
    primary.send((ShutdownCommand(),))
    runner.join(timeout=10)
    assert not runner.is_alive()
    primary.close()
    worker.close()


def test_abort_elsewhere_ends_the_request_another_frontend_runs(tmp_path: object) -> None:
    engine = FakeCore(fake_config(tmp_path), vocab_size=64)
    (primary, primary_core), (worker, worker_core) = Pipe(), Pipe()
    loop = CoreLoop(engine, [primary_core, worker_core])
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    # "gate" with n=1 holds (running, silent) after max_tokens until aborted; both frontends use the same id.
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for conn in (worker, primary):
        conn.send((AddCommand(EngineRequest("gate-x", (5, 6, 7), params)),))
        _recv_until(conn, lambda out: any(d.request_id == "gate-x" for d in out.deltas))
    assert engine.stats().num_running == 2

    # 1) From the primary: the worker's namesake ends (the asker's own slice is its own business).
    primary.send((AbortElsewhereCommand(7, ("gate-x", "nope", "gate-x")),))
    assert _recv_reply(primary, 7) == CallReply(7, ["gate-x"])
    assert _finishes(worker, "gate-x") == [FinishReason.ABORT]
    # 2) Nothing runs under that id elsewhere now: an empty answer, and the primary's request goes on.
    primary.send((AbortElsewhereCommand(8, ("gate-x",)),))
    assert _recv_reply(primary, 8) == CallReply(8, [])
    assert engine.stats().num_running == 1
    # 3) The primary's own is ended by an ordinary abort; every block is back.
    primary.send((AbortCommand(("gate-x",)),))
    assert _finishes(primary, "gate-x") == [FinishReason.ABORT]
    assert engine.stats().num_running == 0
    assert engine.stats().num_free_blocks == NUM_BLOCKS
    primary.send((ShutdownCommand(),))
    runner.join(timeout=10)
    assert not runner.is_alive()
    primary.close()
    worker.close()


async def _last_output(
    engine: AsyncEngine, request: GenerateRequest, started: asyncio.Event
) -> GenerateOutput:
    last = None
    async for output in engine.generate(request):
        last = output
        started.set()
    assert last is not None
    return last


async def test_abort_on_one_frontend_ends_a_stream_on_the_other(
    model_dir: Path, tokenizer: Tokenizer
) -> None:
    config = EngineConfig(model=str(model_dir), max_num_seqs=8, max_waiting=16)
    primary, pipes = await start_shared_core(config, num_frontends=2, engine_factory=fake_factory(
        tokenizer.vocab_size, step_delay=0.001))
    try:
        worker = await attach_engine(pipes[0], config)
    except BaseException:
        await primary.shutdown(timeout=5.0)
        raise
    try:
        async with asyncio.timeout(TIMEOUT_S):
            for owner, asker in ((worker, primary), (primary, worker)):
                started = asyncio.Event()
                request = GenerateRequest("gate-s", (5, 6, 7), SamplingParams(max_tokens=2, ignore_eos=True))
                stream = asyncio.create_task(_last_output(owner, request, started))
                await started.wait()
                assert await asker.abort(["gate-s", "unknown"]) == ["gate-s"]
                last = await stream
                assert last.finished
                assert [chunk.finish_reason for chunk in last.chunks] == [FinishReason.ABORT]
                assert owner.num_in_flight == 0
                stats = await asker.wait_idle()  # the engine-wide count, as the asker sees it
                assert stats.num_running == stats.num_waiting == 0
            assert await worker.abort(["gate-s"]) == []  # nothing in flight anywhere: no id comes back
    finally:
        await worker.shutdown(timeout=5.0)
        await primary.shutdown(timeout=5.0)


async def test_a_replacement_frontend_joins_the_running_core(model_dir: Path, tokenizer: Tokenizer) -> None:
    """--api-workers: a worker process that died is replaced by one on a new pipe, handed to the running core;
    its requests are its own (the same id as one its predecessor ran is a new request)."""
    config = EngineConfig(model=str(model_dir), max_num_seqs=8, max_waiting=16)
    primary, pipes = await start_shared_core(config, num_frontends=2, engine_factory=fake_factory(
        tokenizer.vocab_size, step_delay=0.001))
    try:
        async with asyncio.timeout(TIMEOUT_S):
            worker = await attach_engine(pipes[0], config)
            started = asyncio.Event()
            endless = GenerateRequest("same-id", (5, 6, 7), SamplingParams(max_tokens=200, ignore_eos=True))
            stream = asyncio.create_task(_last_output(worker, endless, started))
            await started.wait()
            await worker.shutdown(timeout=0.0)  # its pipe closes with a request in flight, as at a crash
            assert (await stream).finished
            successor = await attach_engine(primary.new_frontend_pipe(), config)
            try:
                request = GenerateRequest("same-id", (5, 6, 7), SamplingParams(max_tokens=3, ignore_eos=True))
                last = await _last_output(successor, request, asyncio.Event())
                assert [chunk.finish_reason for chunk in last.chunks] == [FinishReason.LENGTH]
                assert successor.stats().num_total_blocks == NUM_BLOCKS
                stats = await primary.wait_idle()  # the predecessor's request was aborted in the core
                assert stats.num_running == stats.num_waiting == 0
            finally:
                await successor.shutdown(timeout=5.0)
    finally:
        await primary.shutdown(timeout=5.0)
    with pytest.raises(EngineDead):
        primary.new_frontend_pipe()  # no core to join any more
