#!/usr/bin/env python3
"""HTTP/2 edges (issue 37, item 7) observed on a live `engine-server` (the simulated engine): not a test.

- streams: one connection opens LIMIT + 1 Generate streams at once on a server started with
  --max-concurrent-streams LIMIT (also its SETTINGS_MAX_CONCURRENT_STREAMS), the first LIMIT held open by the
  client: what the extra stream gets, what the others get, and whether the connection serves on.
- timeout: a Generate and a Tokenize with malformed grpc-timeout values: the status and message.
- log-flood: K connections closed for a PING flood, then K calls with a wrong API key: the server's log
  lines about them (counted after the server stopped, so a count logged at its close is in).

Usage: h2_edges.py [--limit 4] [--connections 200] [--calls 200]. Prints markdown rows (BENCHMARKS.md,
"## Reliability"); run it with PYTHONPATH pointing at another copy of server/ to measure that one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import struct
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from engine_proto.engine.v1 import generate_pb2, tokenize_pb2  # noqa: E402
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub  # noqa: E402
from grpclib.client import Channel  # noqa: E402
from grpclib.exceptions import GRPCError  # noqa: E402
from grpclib.metadata import decode_grpc_message  # noqa: E402
from h2.config import H2Configuration  # noqa: E402
from h2.connection import H2Connection  # noqa: E402
from h2.errors import ErrorCodes  # noqa: E402
from h2.events import (  # noqa: E402
    ConnectionTerminated,
    DataReceived,
    Event,
    ResponseReceived,
    StreamReset,
    TrailersReceived,
)
from serverproc import start_server  # noqa: E402

WAIT_S = 10.0
API_KEY = "h2-edges-bench-key-0123456789"
GENERATE = "/engine.v1.EngineService/Generate"
TOKENIZE = "/engine.v1.EngineService/Tokenize"


class Client:
    """A raw HTTP/2 connection: writes what it is told, reads until a condition holds."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.conn = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.reader, self.writer = reader, writer
        self.events: list[Event] = []
        self.is_closed = False

    def call(self, path: str, message: bytes, *, end_stream: bool = True,
             metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {API_KEY}"),)) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                           (":authority", "bench"), ("content-type", "application/grpc"),
                                           ("te", "trailers"), *metadata])
        self.conn.send_data(stream_id, struct.pack(">BI", 0, len(message)) + message, end_stream=end_stream)
        return stream_id

    async def read_until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT_S):
            while not done() and not self.is_closed:
                self.writer.write(self.conn.data_to_send())
                data = await self.reader.read(1 << 16)
                if not data:
                    self.is_closed = True
                    break
                for event in self.conn.receive_data(data):
                    self.events.append(event)
                    if isinstance(event, DataReceived):
                        self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, ConnectionTerminated):
                        self.is_closed = True

    def trailers(self, stream_id: int) -> dict[str, str]:
        headers: dict[str, str] = {}
        for event in self.events:
            if isinstance(event, ResponseReceived | TrailersReceived) and event.stream_id == stream_id:
                headers.update((str(k), str(v)) for k, v in event.headers)
        return headers

    def reset_code(self, stream_id: int) -> int | None:
        codes = [int(e.error_code) for e in self.events
                 if isinstance(e, StreamReset) and e.stream_id == stream_id and e.error_code is not None]
        return codes[0] if codes else None

    def goaway(self) -> ConnectionTerminated | None:
        found = [e for e in self.events if isinstance(e, ConnectionTerminated)]
        return found[0] if found else None


def _has_status(client: Client, stream_id: int) -> bool:
    return "grpc-status" in client.trailers(stream_id)


async def _connect(port: int) -> Client:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WAIT_S)
    return Client(reader, writer)


def _generate(max_tokens: int) -> bytes:
    request = generate_pb2.GenerateRequest(request_id="", stream=True)
    request.token_ids.ids.extend([5, 6, 7])
    request.stopping.max_tokens = max_tokens
    return request.SerializeToString()


async def streams(port: int, limit: int) -> list[str]:
    client = await _connect(port)
    try:
        # With the preface, before the server's SETTINGS are read: the client's h2 does not know the limit.
        held = [client.call(GENERATE, _generate(3), end_stream=False) for _ in range(limit)]
        extra = client.call(GENERATE, _generate(3))

        def extra_done() -> bool:
            return client.reset_code(extra) is not None or "grpc-status" in client.trailers(extra)

        await client.read_until(extra_done)
        await client.read_until(lambda: all("grpc-status" in client.trailers(s) for s in held))
        goaway = client.goaway()
        code = client.reset_code(extra)
        extra_got = (f"RST_STREAM({ErrorCodes(code).name})" if code is not None
                     else f"grpc-status {client.trailers(extra).get('grpc-status')}")
        if goaway is not None:
            extra_got = f"GOAWAY({ErrorCodes(int(goaway.error_code or 0)).name}, last stream " \
                        f"{goaway.last_stream_id})"
        statuses = [client.trailers(s).get("grpc-status", "none") for s in held]
        resets = [client.reset_code(s) for s in held]  # (error codes, None for none)
        num_ok = statuses.count("0")
        after = "not tried (connection closed)"
        if not client.is_closed:
            for stream_id in held:
                if client.reset_code(stream_id) is None:  # (a server may end its answer with RST_STREAM)
                    client.conn.end_stream(stream_id)
            next_call = client.call(GENERATE, _generate(2))
            await client.read_until(lambda: "grpc-status" in client.trailers(next_call))
            after = f"grpc-status {client.trailers(next_call).get('grpc-status', 'none')}"
        return [f"| {limit} + 1 streams on one connection | extra stream: {extra_got}; the {limit} others: "
                f"{num_ok} OK, {limit - num_ok} lost (grpc-status {statuses}, resets {resets}); next call on "
                f"it: {after} |"]
    finally:
        client.writer.close()


async def timeouts(port: int) -> list[str]:
    rows = []
    for path, message in ((GENERATE, _generate(2)), (TOKENIZE, tokenize_pb2.TokenizeRequest(
            text="hi").SerializeToString())):
        for value in ("1x", "abc", "99999999999S"):
            client = await _connect(port)
            try:
                stream_id = client.call(path, message, metadata=(("grpc-timeout", value),
                                                                 ("authorization", f"Bearer {API_KEY}")))
                await client.read_until(functools.partial(_has_status, client, stream_id))
                trailers = client.trailers(stream_id)
                status = trailers.get("grpc-status", "none")
                message_text = decode_grpc_message(trailers.get("grpc-message", ""))
                rows.append(f"| grpc-timeout {value!r}, {path.rsplit('/', 1)[1]} | grpc-status {status}: "
                            f"{message_text!r} |")
            finally:
                client.writer.close()
    return rows


async def ping_floods(port: int, num_connections: int) -> None:
    for _ in range(num_connections):
        client = await _connect(port)
        try:
            for _ in range(10):
                client.conn.ping(b"12345678")
            await client.read_until(lambda: False)  # until the server hangs up
        finally:
            client.writer.close()


async def wrong_keys(port: int, num_calls: int) -> None:
    channel = Channel("127.0.0.1", port)
    try:
        stub = EngineServiceStub(channel)
        for _ in range(num_calls):
            with contextlib.suppress(GRPCError):
                await stub.Tokenize(tokenize_pb2.TokenizeRequest(text="x"), timeout=WAIT_S,
                                    metadata={"authorization": "Bearer wrong"})
    finally:
        channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    server = start_server("--simulated-engine", "5", "--max-concurrent-streams", str(args.limit),
                          "--api-key", API_KEY)
    rows: list[str] = []
    try:
        rows += asyncio.run(streams(server.port, args.limit))
        rows += asyncio.run(timeouts(server.port))
        asyncio.run(ping_floods(server.port, args.connections))
        asyncio.run(wrong_keys(server.port, args.calls))
    finally:
        server.stop()
    log = server.log().splitlines()
    goaway_lines = [line for line in log if "closing HTTP/2 connection" in line
                    or ("more in the last" in line and "HTTP/2" in line)]
    key_lines = [line for line in log if "rejected call to" in line or "invalid API key" in line]
    rows.append(f"| {args.connections} connections closed for a PING flood | {len(goaway_lines)} log lines |")
    rows.append(f"| {args.calls} calls with a wrong API key | {len(key_lines)} log lines |")
    print("\n".join(rows))
    print("\nlog lines (first 3 of each):", *goaway_lines[:3], *key_lines[:3], sep="\n")


if __name__ == "__main__":
    main()
