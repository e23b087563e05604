"""The shared engine core (--api-workers): admission bugs fail one request only; per-completion aborts."""

from __future__ import annotations

import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from engine_server.engine.types import EngineRequest, FinishReason, SamplingParams
from engine_server.frontend.core_multi import _MultiCoreLoop
from engine_server.frontend.messages import AbortCompletionsCommand, AddCommand, ShutdownCommand, StepOutput
from fake_core import NUM_BLOCKS, FakeCore, fake_config


class _AdmissionBugEngine(FakeCore):
    """Raises an unexpected error (not a RequestError) when admitting ids containing "bug"."""

    def add_request(self, request: EngineRequest) -> None:
        if "bug" in request.request_id:
            raise RuntimeError("core bug while admitting")
        super().add_request(request)


def _recv_until(conn: Connection, predicate: object, *, timeout: float = 10.0) -> StepOutput:
    while conn.poll(timeout):
        message = conn.recv()
        if isinstance(message, StepOutput) and predicate(message):  # type: ignore[operator]
            return message
    raise AssertionError("no matching StepOutput before the timeout")


def test_unexpected_admission_error_rejects_only_that_request(tmp_path: object) -> None:
    engine = _AdmissionBugEngine(fake_config(tmp_path), vocab_size=64)
    frontend, core = Pipe()
    loop = _MultiCoreLoop(engine, [core])
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
    loop = _MultiCoreLoop(engine, [primary_core, worker_core])
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
