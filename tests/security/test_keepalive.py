"""Keepalive: the server PINGs connections with calls in flight and closes those that stop answering."""

from __future__ import annotations

from engine_proto.engine.v1 import generate_pb2
from engine_server.api.security import SecurityConfig
from sec_fakes import serve
from sec_raw_h2 import raw_h2

GENERATE = "/engine.v1.EngineService/Generate"
FOREVER = generate_pb2.GenerateRequest(request_id="forever").SerializeToString()
# Short periods so the test takes well under a second; the waits below are bounded by WAIT_S.
FAST = SecurityConfig(keepalive_time_s=0.1, keepalive_timeout_s=0.3)


async def test_silent_peer_is_closed_and_its_requests_aborted() -> None:
    async with serve(FAST) as served, raw_h2(served.port) as raw:
        raw.start_call(GENERATE, FOREVER)
        await raw.flush()
        await served.engine.wait_for(lambda: len(served.engine.running) == 1)
        raw.is_mute = True  # the client's host vanished: nothing answers the server's PINGs
        await raw.wait_closed()
        assert raw.num_pings >= 1
        await served.engine.wait_for(lambda: not served.engine.running)
        assert served.engine.num_aborted == 1


async def test_answering_peer_is_kept_alive() -> None:
    async with serve(FAST) as served, raw_h2(served.port) as raw:
        raw.start_call(GENERATE, FOREVER)
        await raw.flush()
        await served.engine.wait_for(lambda: len(served.engine.running) == 1)
        # Five keepalive rounds: each PING answered (by the reader) well within the timeout.
        await raw.wait_until(lambda: raw.num_pings >= 5)
        assert not raw.is_closed
        assert served.engine.running == {"forever"}
        assert served.server.guard_stats.goaways == {}
