"""The shared engine core (--api-workers): one request's admission bug fails that request only."""

from __future__ import annotations

import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from engine_server.engine.types import EngineRequest, SamplingParams
from engine_server.frontend.core_multi import _MultiCoreLoop
from engine_server.frontend.messages import AddCommand, ShutdownCommand, StepOutput
from fake_core import FakeCore, fake_config


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
