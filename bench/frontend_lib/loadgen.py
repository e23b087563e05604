"""The load generator: runs in its own process (pinned to its own core by the caller), prints a JSON summary.

gRPC: grpclib + upb `_pb2` over one HTTP/2 connection (streams multiplexed, as gRPC clients do); the only
per-message work is `len(token_ids)` on the parsed message. SSE: raw asyncio HTTP/1.1, one keep-alive
connection per worker (as HTTP clients do), chunked transfer decoding and one `json.loads` per event.

Usage: loadgen.py {grpc|sse} --port N --concurrency C --num-requests R [--prompt 100] [--output 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

from engine_proto.engine.v1 import generate_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_server.api.transport.write_batch import BatchingTransport
from grpclib.client import Channel, Handler
from grpclib.protocol import H2Protocol

from frontend_lib.h2_client import H2GrpcConnection
from frontend_lib.workload import (
    RequestTrace,
    SendFn,
    closed_loop,
    cpu_seconds_self,
    prompt_ids,
    prompt_text,
    summarize,
)

REQUEST_TIMEOUT_S = 600.0


class _BatchingProtocol(H2Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The client's WINDOW_UPDATEs for all streams go out in one write per loop tick (as the server's do).
        super().connection_made(BatchingTransport(transport, asyncio.get_running_loop()))  # type: ignore[arg-type]


class _BatchingChannel(Channel):
    def _protocol_factory(self) -> H2Protocol:
        return _BatchingProtocol(Handler(), self._config, self._h2_config)


def _request(i: int, *, prompt: int, output: int, tag: str, ids_only: bool,
             text_input: bool = False) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(request_id=f"{tag}-{i}", stream=True)
    if text_input:  # a client that sends text: the server tokenizes it
        request.text = prompt_text(i, prompt)
    else:
        request.token_ids.ids.extend(prompt_ids(i, prompt))
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = output
    request.stopping.ignore_eos = True
    if ids_only:  # a token-id-native client (a router that detokenizes itself): no text in the responses
        request.output.return_text = False
    return request


def grpc_sender(channel: Channel, *, prompt: int, output: int, tag: str, ids_only: bool = False,
                text_input: bool = False) -> SendFn:
    stub = EngineServiceStub(channel)

    async def send(i: int, trace: RequestTrace) -> None:
        request = _request(i, prompt=prompt, output=output, tag=tag, ids_only=ids_only, text_input=text_input)
        arrivals = trace.arrivals
        clock = time.perf_counter
        async with stub.Generate.open(timeout=REQUEST_TIMEOUT_S) as stream:
            await stream.send_message(request, end=True)
            async for response in stream:
                arrivals.append((clock(), sum(len(c.token_ids) for c in response.completions)))

    return send


def h2_sender(conn: H2GrpcConnection, *, prompt: int, output: int, tag: str,
              ids_only: bool = False, text_input: bool = False) -> SendFn:
    """The default gRPC client: raw HTTP/2 frames (frontend_lib/h2_client.py) + upb parsing per message."""
    path = "/engine.v1.EngineService/Generate"
    parse = generate_pb2.GenerateResponse.FromString

    async def send(i: int, trace: RequestTrace) -> None:
        request = _request(i, prompt=prompt, output=output, tag=tag, ids_only=ids_only, text_input=text_input)
        arrivals = trace.arrivals
        clock = time.perf_counter

        def on_message(data: bytes) -> None:
            arrivals.append((clock(), sum(len(c.token_ids) for c in parse(data).completions)))

        await asyncio.wait_for(conn.call(path, request.SerializeToString(), on_message), REQUEST_TIMEOUT_S)

    return send


class _SseConnection:
    """One keep-alive HTTP/1.1 connection; `post` streams one completion and records its events."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    async def post(self, body: bytes, trace: RequestTrace) -> None:
        self.writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: " + self.host.encode() + b"\r\nContent-Type: "
            b"application/json\r\nAccept: text/event-stream\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        reader = self.reader
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"SSE server answered {head[:60]!r}")
        if b"chunked" not in head.lower():
            raise RuntimeError("expected a chunked event stream")
        arrivals, clock, loads = trace.arrivals, time.perf_counter, json.loads
        buffer = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return
            buffer += data[:-2]
            while True:
                end = buffer.find(b"\n\n")
                if end < 0:
                    break
                event, buffer = buffer[:end], buffer[end + 2:]
                if event == b"data: [DONE]":
                    continue
                choices = loads(event[6:])["choices"]
                arrivals.append((clock(), sum(len(c["token_ids"]) for c in choices)))


def sse_sender(host: str, port: int, *, prompt: int, output: int, openai_token_ids: bool = False) -> SendFn:
    idle: list[_SseConnection] = []
    # vLLM's OpenAI server sends each event's token ids only when asked (`return_token_ids`)
    extra = {"return_token_ids": True} if openai_token_ids else {}

    async def send(i: int, trace: RequestTrace) -> None:
        conn = idle.pop() if idle else _SseConnection(*await asyncio.open_connection(host, port), host)
        body = json.dumps({"prompt": prompt_ids(i, prompt), "max_tokens": output, "temperature": 0.0,
                           "ignore_eos": True, "stream": True, **extra}).encode()
        await asyncio.wait_for(conn.post(body, trace), REQUEST_TIMEOUT_S)
        idle.append(conn)

    return send


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    channel: Channel | None = None
    conn: H2GrpcConnection | None = None
    if args.kind == "grpc" and args.grpc_client == "grpclib":
        channel = _BatchingChannel(args.host, args.port)
        send = grpc_sender(channel, prompt=args.prompt, output=args.output, tag=args.tag,
                           ids_only=args.ids_only, text_input=args.text_input)
    elif args.kind == "grpc":
        conn = await H2GrpcConnection.connect(args.host, args.port)
        send = h2_sender(conn, prompt=args.prompt, output=args.output, tag=args.tag, ids_only=args.ids_only,
                         text_input=args.text_input)
    else:
        send = sse_sender(args.host, args.port, prompt=args.prompt, output=args.output,
                          openai_token_ids=args.openai_token_ids)
    try:
        cpu0 = cpu_seconds_self()
        traces, wall_s = await closed_loop(send, concurrency=args.concurrency, num_requests=args.num_requests,
                                           first=args.first_request)
        cpu_s = cpu_seconds_self() - cpu0
    finally:
        if channel is not None:
            channel.close()
        if conn is not None:
            conn.close()
    if args.trace_out:  # one line per request, in send order: send time (s from start), TTFT ms, messages
        start = min(t.sent for t in traces)
        lines = []
        for t in sorted(traces, key=lambda t: t.sent):
            first = next((a for a, n in t.arrivals if n > 0), math.nan)
            lines.append(f"{t.sent - start:.4f} {(first - t.sent) * 1e3:.2f} {len(t.arrivals)}\n")
        Path(args.trace_out).write_text("".join(lines))  # after the run: blocking is fine
    return summarize(traces, wall_s=wall_s, client_cpu_s=cpu_s, concurrency=args.concurrency).to_json()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=("grpc", "sse"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--num-requests", type=int, required=True)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--output", type=int, default=100)
    p.add_argument("--tag", default="bench")
    p.add_argument("--first-request", type=int, default=0,
                   help="number of the first request (its prompt: workload.prompt_ids); later runs go on")
    p.add_argument("--grpc-client", choices=("h2", "grpclib"), default="h2")
    p.add_argument("--ids-only", action="store_true", help="gRPC: ask for token ids only (return_text=false)")
    p.add_argument("--text-input", action="store_true",
                   help="gRPC: send each prompt as text (workload.prompt_text), tokenized by the server")
    p.add_argument("--openai-token-ids", action="store_true",
                   help="SSE: ask for each event's token ids as vLLM's OpenAI server does (return_token_ids)")
    p.add_argument("--trace-out", default=None, help="write each request's send time and TTFT here")
    args = p.parse_args()
    import uvloop

    result = uvloop.run(main_async(args))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
