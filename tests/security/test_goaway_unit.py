"""goaway.py: which clients get the early GOAWAY, the frame itself, and the linger before the final one."""

from __future__ import annotations

import grpc
import grpclib.metadata
import pytest
from engine_server.api.security.goaway import (
    GOAWAY_LINGER_S,
    MAX_STREAM_ID,
    drain_goaway_delay_s,
    early_goaway_frame,
    keeps_streams_on_goaway,
)
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import ConnectionTerminated


@pytest.mark.parametrize(
    ("user_agent", "expected"),
    [
        (f"grpc-python/{grpc.__version__} grpc-c/45.0.0 (linux; chttp2)", True),
        ("my-app/2.0 grpc-go/1.70.0", True),
        ("grpc-java-netty/1.68.1", True),
        ("engine-rust/0.1.0 tonic/0.12.3", True),
        (grpclib.metadata.USER_AGENT, False),  # ends every open stream on any GOAWAY
        ("python-httpx/0.27", False),
        (None, False),
        ("", False),
    ],
)
def test_only_clients_known_to_keep_their_streams_get_the_early_goaway(
    user_agent: str | None, expected: bool
) -> None:
    assert keeps_streams_on_goaway(user_agent) is expected


def test_early_goaway_frame_is_a_valid_goaway_for_any_stream() -> None:
    client = H2Connection(H2Configuration(client_side=True))
    client.initiate_connection()
    server = H2Connection(H2Configuration(client_side=False))
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    (event,) = client.receive_data(early_goaway_frame(b"why"))
    assert isinstance(event, ConnectionTerminated)
    assert (event.error_code, event.last_stream_id, event.additional_data) == (
        ErrorCodes.NO_ERROR, MAX_STREAM_ID, b"why"
    )


def test_final_goaway_waits_for_the_linger_unless_the_client_keeps_its_streams() -> None:
    grpclib_ua = grpclib.metadata.USER_AGENT
    assert drain_goaway_delay_s(grpclib_ua, last_stream_end=None, now=100.0) == 0.0  # never had a call
    assert drain_goaway_delay_s(grpclib_ua, last_stream_end=100.0, now=100.25) == GOAWAY_LINGER_S - 0.25
    assert drain_goaway_delay_s(grpclib_ua, last_stream_end=100.0, now=100.0 + GOAWAY_LINGER_S) == 0.0
    assert drain_goaway_delay_s("grpc-go/1.70.0", last_stream_end=100.0, now=100.0) == 0.0
