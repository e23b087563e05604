"""The transport's third-party versions are the pinned ones, and the h2 behaviour its internals rely on.

engine_server/api/transport/ uses private names of grpclib, h2, hpack and hyperframe (scripts/
count_private_names.py lists them). Their versions are pinned exactly in server/pyproject.toml (and in
requirements-dev.txt, which scripts/bootstrap.sh installs): a different version installed fails here. To bump
one: re-check every private name the transport uses against the new version (the count script lists them
with their files), run tests/security, tests/unit/test_h2_streams.py, tests/unit/test_call_streams.py and
tests/api, then change the pins in both files.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from collections import deque
from importlib.metadata import version
from pathlib import Path

import hpack
import pytest
from h2.config import H2Configuration
from h2.connection import ConnectionState, H2Connection
from h2.events import ConnectionTerminated
from h2.exceptions import TooManyStreamsError
from h2.settings import SettingCodes, Settings
from hyperframe.frame import HeadersFrame

ROOT = Path(__file__).resolve().parents[2]
TRANSPORT_PACKAGES = ("grpclib", "h2", "hpack", "hyperframe")


def _exact_pins(requirements: list[str]) -> dict[str, str]:
    pins: dict[str, str] = {}
    for requirement in requirements:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*==\s*([^\s;#,]+)\s*(#.*)?", requirement)
        if match and match.group(1).lower() in TRANSPORT_PACKAGES:
            pins[match.group(1).lower()] = match.group(3)
    return pins


def test_the_transport_packages_are_pinned_exactly_and_installed_at_the_pins() -> None:
    server = tomllib.loads((ROOT / "server" / "pyproject.toml").read_text())
    server_pins = _exact_pins(server["project"]["dependencies"])
    assert sorted(server_pins) == sorted(TRANSPORT_PACKAGES), "pin each exactly (==) in server/pyproject.toml"
    dev_pins = _exact_pins((ROOT / "requirements-dev.txt").read_text().splitlines())
    assert dev_pins == server_pins, "requirements-dev.txt (what CI installs) pins the same versions"
    installed = {name: version(name) for name in TRANSPORT_PACKAGES}
    assert installed == server_pins, (
        "an installed transport package differs from its pin: re-check the private names api/transport/ uses "
        "against it (scripts/count_private_names.py), then bump the pins"
    )


def test_no_private_third_party_name_is_used_outside_api_transport() -> None:
    script = ROOT / "scripts" / "count_private_names.py"
    spec = importlib.util.spec_from_file_location("count_private_names", script)
    assert spec is not None
    assert spec.loader is not None
    counter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counter)
    uses, ambiguous = counter.count(ROOT / "server" / "engine_server")
    # (it finds what is there: a private class imported, a private module)
    assert "_Metadata" in uses
    assert "_typing" in uses
    outside = {name: sorted(f for f in files if not f.startswith("api/transport/"))
               for name, files in {**ambiguous, **uses}.items()}
    assert {name: files for name, files in outside.items() if files} == {}


def test_h2_settings_internals() -> None:
    # h2_guard makes its MAX_CONCURRENT_STREAMS effective before the peer's ACK through Settings._settings.
    settings = Settings(client=False, initial_values={SettingCodes.MAX_CONCURRENT_STREAMS: 7})
    assert list(settings._settings[SettingCodes.MAX_CONCURRENT_STREAMS]) == [7]


def test_h2_queues_its_own_frames_in_data_to_send() -> None:
    # fast_send.py checks h2's _data_to_send before it writes a frame of its own
    connection = H2Connection(H2Configuration(client_side=False))
    connection.initiate_connection()
    assert connection._data_to_send
    assert connection.data_to_send()
    assert not connection._data_to_send


def test_h2_goaway_names_the_last_stream_the_client_opened() -> None:
    # The final drain GOAWAY relies on close_connection's default last_stream_id.
    client = H2Connection(H2Configuration(client_side=True))
    client.initiate_connection()
    server = H2Connection(H2Configuration(client_side=False))
    server.initiate_connection()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", "/x"), (":authority", "a")]
    for stream_id in (1, 3):
        client.send_headers(stream_id, headers, end_stream=True)
    server.receive_data(client.data_to_send())
    server.close_connection()
    events = client.receive_data(server.data_to_send())
    (goaway,) = [e for e in events if isinstance(e, ConnectionTerminated)]
    assert goaway.last_stream_id == 3


def test_h2_refuses_a_stream_past_the_limit_before_anything_changed() -> None:
    # h2_streams.py refuses such a stream alone by catching h2's TooManyStreamsError from the HEADERS
    # frame's handler (which it puts in the connection's frame dispatch table) and opening the stream again:
    # h2 must raise before it decoded the block (the HPACK table), counted the frame or made the stream.
    server = H2Connection(H2Configuration(client_side=False))
    server.initiate_connection()
    server.local_settings._settings[SettingCodes.MAX_CONCURRENT_STREAMS] = deque([1])
    assert server._frame_dispatch_table[HeadersFrame] == server._receive_headers_frame
    encoder = hpack.Encoder()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", "/x"), (":authority", "a"), ("x-new", "1")]
    server.receive_data(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _headers_frame(1, encoder.encode(headers)))
    table_size = len(server.decoder.header_table.dynamic_entries)
    second = HeadersFrame(3)
    second.data = encoder.encode([*headers, ("x-second", "2")])
    second.flags.add("END_HEADERS")
    with pytest.raises(TooManyStreamsError):
        server._receive_headers_frame(second)
    assert len(server.decoder.header_table.dynamic_entries) == table_size
    assert 3 not in server.streams
    assert server.highest_inbound_stream_id == 1
    assert server.state_machine.state is ConnectionState.SERVER_OPEN


def _headers_frame(stream_id: int, block: bytes) -> bytes:
    frame = HeadersFrame(stream_id)
    frame.data = block
    frame.flags.add("END_HEADERS")
    return frame.serialize()
