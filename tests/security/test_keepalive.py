"""Keepalive and idle connections: PINGs while calls are in flight; silent or idle connections are closed."""

from __future__ import annotations

from engine_proto.engine.v1 import generate_pb2
from engine_proto.engine.v1.tokenize_pb2 import TokenizeRequest
from engine_server.api.security import H2Policy, SecurityConfig
from h2.errors import ErrorCodes
from sec_fakes import serve
from sec_raw_h2 import raw_h2

GENERATE = "/engine.v1.EngineService/Generate"
TOKENIZE = "/engine.v1.EngineService/Tokenize"
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


IDLE = SecurityConfig(keepalive_time_s=0.1, keepalive_timeout_s=5.0, h2=H2Policy(max_connection_idle_s=0.2))


async def test_idle_connection_gets_goaway_no_error() -> None:
    async with serve(IDLE) as served:
        # A connection that never calls, and one that called once and then went quiet.
        async with raw_h2(served.port) as silent, raw_h2(served.port) as finished:
            stream_id = finished.start_call(TOKENIZE, TokenizeRequest(text="x").SerializeToString())
            await finished.flush()
            await finished.wait_stream_done(stream_id)
            for raw in (silent, finished):
                await raw.wait_closed()
                assert raw.goaway is not None
                assert (raw.goaway.error_code, raw.goaway.additional_data) == (ErrorCodes.NO_ERROR, b"idle")
        assert served.server.guard_stats.goaways == {"idle": 2}


async def test_connection_with_a_call_in_flight_is_not_idle() -> None:
    async with serve(IDLE) as served, raw_h2(served.port) as raw:
        raw.start_call(GENERATE, FOREVER)
        await raw.flush()
        await served.engine.wait_for(lambda: len(served.engine.running) == 1)
        await raw.wait_until(lambda: raw.num_pings >= 8)  # 0.8 s: four idle periods
        assert not raw.is_closed
        assert served.server.guard_stats.goaways == {}
