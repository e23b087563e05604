"""BatchingTransport: the writes of one loop tick leave in one write, in order; close and abort behave."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

from engine_server.api.transport.write_batch import BatchingTransport
from engine_server.engine.types import CompletionDelta, FinishReason, TokenLogprob


class _Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0


async def test_one_write_per_tick_in_order() -> None:
    inner = _Recorder()
    transport = BatchingTransport(inner, asyncio.get_running_loop())
    for i in range(5):
        transport.write(b"frame%d;" % i)
    assert inner.writes == []
    assert transport.get_write_buffer_size() == 5 * len(b"frame0;")
    await asyncio.sleep(0)
    assert inner.writes == [b"frame0;frame1;frame2;frame3;frame4;"]
    transport.write(b"next")
    transport.flush()  # an explicit flush sends at once; the scheduled one finds nothing left
    await asyncio.sleep(0)
    assert inner.writes[1:] == [b"next"]


async def test_close_flushes_and_abort_drops() -> None:
    inner = _Recorder()
    transport = BatchingTransport(inner, asyncio.get_running_loop())
    transport.write(b"goaway")
    transport.close()
    assert inner.writes == [b"goaway"]
    assert inner.closed
    assert transport.is_closing()

    other = _Recorder()
    transport = BatchingTransport(other, asyncio.get_running_loop())
    transport.write(b"lost")
    transport.abort()
    await asyncio.sleep(0)
    assert other.writes == []
    assert other.aborted


def test_completion_delta_pickles_round_trip() -> None:
    # The compact __reduce__ of the hot IPC message keeps every field.
    plain = CompletionDelta("r", 0, [5])
    full = CompletionDelta(
        "r", 2, [7, 8], logprobs=[TokenLogprob(7, -0.5, 1, ((7, -0.5),))], finish_reason=FinishReason.STOP,
        stop_token_id=8, num_prompt_tokens=3, num_cached_prompt_tokens=2, prompt_logprobs=[None],
        error=None,
    )
    for delta in (plain, full, CompletionDelta("r", 1, [], finish_reason=FinishReason.ERROR, error="x")):
        assert pickle.loads(pickle.dumps(delta, protocol=pickle.HIGHEST_PROTOCOL)) == delta
    assert len(pickle.dumps(plain)) < len(pickle.dumps(full))
