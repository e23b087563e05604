"""CallResources: a Generate call's in-flight place, stream slot and engine stream are released together,
once, however many of the call's ends (last message, reset, lost connection, deadline, error) ask for it."""

from __future__ import annotations

import asyncio

from engine_server.api.in_flight import InFlight
from engine_server.api.stream_limit import LocalStreamLimit, StreamSlot


class _Outputs:
    def __init__(self) -> None:
        self.num_closes = 0

    def close(self) -> None:
        self.num_closes += 1


def test_every_end_after_the_first_releases_nothing() -> None:
    in_flight, limit, outputs = InFlight(), LocalStreamLimit(2), _Outputs()
    other = in_flight.begin()  # another call, still running
    slot = StreamSlot.try_take(limit)
    assert slot is not None
    resources = in_flight.admit(slot, outputs)
    assert in_flight.count == 2
    for _ in range(3):  # e.g. the pushed end, then a cancel, then the task's finally
        resources.release()
    assert resources.is_released
    assert in_flight.count == 1
    assert outputs.num_closes == 1
    assert StreamSlot.try_take(limit) is not None  # the slot went back (once: two places again)
    assert StreamSlot.try_take(limit) is not None
    assert StreamSlot.try_take(limit) is None
    other.release()
    assert in_flight.count == 0


def test_a_call_released_before_its_admission_gives_back_what_admission_took() -> None:
    in_flight, limit, outputs = InFlight(), LocalStreamLimit(1), _Outputs()
    resources = in_flight.begin()
    resources.release()  # e.g. cancelled while its text was tokenized
    slot = StreamSlot.try_take(limit)
    assert slot is not None
    resources.admitted(slot, outputs)
    assert outputs.num_closes == 1
    assert StreamSlot.try_take(limit) is not None
    assert in_flight.count == 0


def test_a_drain_waits_for_the_last_release() -> None:
    async def main() -> None:
        in_flight = InFlight()
        first, second = in_flight.admit(None, _Outputs()), in_flight.admit(None, _Outputs())
        waiter = asyncio.ensure_future(in_flight.wait_idle())
        first.release()
        first.release()  # a second end of the same call does not count for the other one
        await asyncio.sleep(0)
        assert not waiter.done()
        second.release()
        await asyncio.wait_for(waiter, timeout=1.0)

    asyncio.run(main())
