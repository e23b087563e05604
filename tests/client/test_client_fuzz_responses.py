"""Property-based fuzzing of the clients' receive side: whatever a server answers, a call of either client
(async on grpclib, sync on grpcio) returns a typed result or raises an `EngineError`, within its deadline.

A raw HTTP/2 server (client_raw_server.py) answers with Hypothesis-drawn replies: response headers with any
status and content type, or none; response messages of the call's type drawn field by field (values at the
edges: negative enum numbers, huge indexes), bytes that are no message, frames whose length prefix lies or
that claim compression; trailers with any grpc-status, grpc-message and status details, or a reset, a GOAWAY,
a closed connection, silence. A reply that is a well-formed gRPC answer (200, a gRPC content type, valid
messages, exactly one for a unary call, grpc-status 0) must succeed; the async client must log no error.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from client_raw_server import Headers, RawServer, Reply, raw_server
from engine_client import AsyncEngineClient, ConnectionOptions, EngineClient, EngineError, RetryPolicy
from engine_proto.engine.v1 import generate_pb2, info_pb2, tokenize_pb2
from fuzz_proto import MessageFuzzer, grpc_message
from fuzz_settings import fuzz_settings
from google.protobuf.message import Message
from hypothesis import event, given
from hypothesis import strategies as st

pytestmark = pytest.mark.asyncio(loop_scope="module")

TIMEOUT_S = 1.0  # each call's deadline: a reply that never ends costs this much
WAIT_S = 15.0  # a call that outlives its deadline by this much hangs

# call -> (its response type, is it unary)
CALLS: dict[str, tuple[type[Message], bool]] = {
    "generate": (generate_pb2.GenerateResponse, False),
    "complete": (generate_pb2.GenerateResponse, False),
    "tokenize": (tokenize_pb2.TokenizeResponse, True),
    "model_info": (info_pb2.GetModelInfoResponse, True),
    "server_info": (info_pb2.GetServerInfoResponse, True),
    "load": (info_pb2.GetLoadResponse, True),
}
_FUZZER = MessageFuzzer(small=1 << 20, max_repeated=4, long_repeated=200, depth=3)
_GRPC_TYPES = (b"application/grpc", b"application/grpc+proto")


@dataclass(frozen=True, slots=True)
class Piece:
    data: bytes
    is_valid: bool  # one well-framed, uncompressed message of the call's response type


def _pieces(response_type: type[Message]) -> st.SearchStrategy[Piece]:
    messages = _FUZZER.messages(response_type).map(lambda m: m.SerializeToString())
    return st.one_of(
        messages.map(lambda body: Piece(grpc_message(body), True)),
        messages.map(lambda body: Piece(grpc_message(body), True)),
        st.binary(min_size=1, max_size=40).map(lambda body: Piece(grpc_message(body), False)),
        st.tuples(messages, st.integers(0, (1 << 32) - 1)).map(
            lambda m: Piece(grpc_message(m[0], length=m[1]), False)),
        messages.map(lambda body: Piece(grpc_message(body, is_compressed=1), False)),
        st.binary(max_size=6).map(lambda data: Piece(data, False)),  # unframed, or a prefix cut short
    )


_STATUS_VALUES = st.sampled_from([str(code) for code in range(17)] + ["99", "-1", "abc", "", " 0"])
_TRAILER = st.one_of(
    st.tuples(st.just(b"grpc-status"), _STATUS_VALUES.map(str.encode)),
    st.tuples(st.just(b"grpc-message"), st.binary(max_size=24)),
    st.tuples(st.just(b"grpc-message"), st.text(max_size=12).map(lambda t: t.encode())),
    st.tuples(st.just(b"grpc-status-details-bin"), st.binary(max_size=24)),
    st.tuples(st.just(b"grpc-status-details-bin"), st.binary(max_size=24).map(base64.b64encode)),
)
_RESPONSE_HEADERS = st.tuples(
    st.sampled_from([b"200", b"200", b"200", b"404", b"503", b"abc"]).map(lambda v: ((b":status", v),)),
    st.sampled_from([_GRPC_TYPES[0], _GRPC_TYPES[1], b"text/html", None]).map(
        lambda v: ((b"content-type", v),) if v is not None else ()),
).map(lambda parts: parts[0] + parts[1])


@dataclass(frozen=True, slots=True)
class Case:
    call: str
    reply: Reply
    is_well_formed: bool


@st.composite
def cases(draw: Callable[..., Any]) -> Case:
    call = draw(st.sampled_from(sorted(CALLS)))
    response_type, is_unary = CALLS[call]
    headers: Headers | None = draw(st.one_of(_RESPONSE_HEADERS, _RESPONSE_HEADERS, st.none()))
    is_trailers_only = headers is not None and draw(st.booleans()) and draw(st.booleans())
    trailers: Headers = tuple(draw(st.lists(_TRAILER, max_size=3)))
    if is_trailers_only:
        assert headers is not None
        headers = headers + trailers
    pieces = draw(st.lists(_pieces(response_type), max_size=4))
    ending = draw(st.sampled_from(["trailers"] * 3 + ["end", "reset", "goaway", "close", "hang"]))
    if draw(st.booleans()):  # the answer a working server gives, now and then
        headers = ((b":status", b"200"), (b"content-type", _GRPC_TYPES[0]))
        trailers, ending, is_trailers_only = ((b"grpc-status", b"0"),), "trailers", False
    reply = Reply(headers, tuple(piece.data for piece in pieces), ending, trailers, is_trailers_only)
    is_well_formed = (
        headers is not None and not is_trailers_only and dict(headers).get(b":status") == b"200"
        and dict(headers).get(b"content-type") in _GRPC_TYPES
        and all(piece.is_valid for piece in pieces) and (len(pieces) == 1 if is_unary else True)
        and sum(len(piece.data) for piece in pieces) < 60_000  # (within the client's flow-control window)
        and ending == "trailers" and trailers == ((b"grpc-status", b"0"),)
    )
    return Case(call, reply, is_well_formed)


async def _call_async(client: AsyncEngineClient, call: str) -> object:
    if call == "generate":
        return [chunk async for chunk in client.generate(token_ids=[1, 2, 3])]
    if call == "complete":
        return await client.complete(token_ids=[1, 2, 3])
    if call == "tokenize":
        return await client.tokenize("hello")
    method: Callable[[], Any] = getattr(client, call)
    return await method()


def _call_sync(client: EngineClient, call: str) -> object:
    if call == "generate":
        return list(client.generate(token_ids=[1, 2, 3]))
    if call == "complete":
        return client.complete(token_ids=[1, 2, 3])
    if call == "tokenize":
        return client.tokenize("hello")
    method: Callable[[], Any] = getattr(client, call)
    return method()


@dataclass(slots=True)
class Clients:
    aio: AsyncEngineClient
    sync: EngineClient


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server() -> AsyncIterator[RawServer]:
    async with raw_server() as server:
        yield server


@contextlib.asynccontextmanager
async def fresh_clients(server: RawServer, reply: Reply) -> AsyncIterator[Clients]:
    """Both clients, on new connections (what an earlier reply did to a connection stays with it)."""
    server.reply = reply
    # retries: one, without waiting (the server answers a retry as it answered the first attempt)
    options = ConnectionOptions(f"127.0.0.1:{server.port}", timeout=TIMEOUT_S,
                                retry=RetryPolicy(max_attempts=2, initial_backoff=0.0, max_backoff=0.0))
    aio = AsyncEngineClient(options)
    sync = EngineClient(options)
    try:
        yield Clients(aio, sync)
    finally:
        await aio.close()
        sync.close()


async def _outcome(run: Callable[[], Any]) -> str:
    try:
        async with asyncio.timeout(TIMEOUT_S + WAIT_S):
            await run()
    except EngineError as exc:
        return exc.code.name
    return "OK"


_OK_HEADERS: Headers = ((b":status", b"200"), (b"content-type", b"application/grpc"))
_OK_TRAILERS: Headers = ((b"grpc-status", b"0"),)
_LOAD = grpc_message(info_pb2.GetLoadResponse(state=info_pb2.ENGINE_STATE_SERVING).SerializeToString())


# Found by the fuzz test below: the async client let each of these out as the raw error grpclib raised
# (DecodeError, NotImplementedError, AssertionError, KeyError, binascii.Error), or returned the first of two
# replies; the sync client returned None for a reply that never came.
@pytest.mark.parametrize(("reply", "sync_codes"), [
    pytest.param(Reply(_OK_HEADERS, (grpc_message(b"\xff\xff"),), "trailers", _OK_TRAILERS), {"INTERNAL"},
                 id="a reply that does not parse"),
    pytest.param(Reply(_OK_HEADERS, (grpc_message(b"", is_compressed=1),), "trailers", _OK_TRAILERS),
                 {"INTERNAL"}, id="a reply that claims compression"),
    pytest.param(Reply(_OK_HEADERS, (_LOAD[:-1],), "trailers", _OK_TRAILERS), {"INTERNAL"},
                 id="a stream that ends inside the reply"),
    pytest.param(Reply(_OK_HEADERS, (_LOAD[:3],), "trailers", _OK_TRAILERS), {"INTERNAL"},
                 id="a stream that ends inside the reply's prefix"),
    pytest.param(Reply(_OK_HEADERS[1:], (_LOAD,), "trailers", _OK_TRAILERS), {"OK"},
                 id="headers without :status"),
    pytest.param(Reply(_OK_HEADERS, (), "trailers", ((b"grpc-status", b"14"), (b"x-bin", b"not base64"))),
                 {"INTERNAL"}, id="binary metadata that is not base64"),
    pytest.param(Reply(_OK_HEADERS, (), "trailers", _OK_TRAILERS), {"INTERNAL"},
                 id="no reply, status OK"),
    pytest.param(Reply(_OK_HEADERS, (_LOAD, _LOAD), "trailers", _OK_TRAILERS),
                 {"INTERNAL", "DEADLINE_EXCEEDED"}, id="two replies"),
])
async def test_a_malformed_reply_is_an_engine_error(
    server: RawServer, reply: Reply, sync_codes: set[str]
) -> None:
    async with fresh_clients(server, reply) as clients:
        assert await _outcome(lambda: _call_async(clients.aio, "load")) == "INTERNAL"
        # (grpcio reads the reply itself: its code, as it gives it)
        assert await _outcome(lambda: asyncio.to_thread(_call_sync, clients.sync, "load")) in sync_codes


async def test_a_header_that_is_not_ascii_ends_the_call_quietly(
    server: RawServer, caplog: pytest.LogCaptureFixture
) -> None:
    # grpclib's h2 let a UnicodeDecodeError out of data_received: asyncio logged "Fatal error" with a
    # traceback and closed the connection under its calls.
    reply = Reply((*_OK_HEADERS, (b"x-note", b"\xff")), (_LOAD,), "trailers", _OK_TRAILERS)
    async with fresh_clients(server, reply) as clients:
        assert await _outcome(lambda: _call_async(clients.aio, "load")) == "UNAVAILABLE"
    assert _errors_logged(caplog) == []


def _errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the async client's side logged as errors (grpcio logs a message that does not parse itself)."""
    return [record.getMessage() for record in caplog.records
            if record.levelno >= logging.ERROR and not record.name.startswith("grpc._")]


@fuzz_settings(ci_examples=100)
@given(case=cases())
async def test_any_reply_is_a_typed_result_or_an_engine_error(
    server: RawServer, case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.clear()
    async with fresh_clients(server, case.reply) as clients:
        outcomes = {
            "async": await _outcome(lambda: _call_async(clients.aio, case.call)),
            "sync": await _outcome(lambda: asyncio.to_thread(_call_sync, clients.sync, case.call)),
        }
    event(f"{case.call}: {outcomes['async']} / {outcomes['sync']}")
    if case.is_well_formed:
        assert outcomes == {"async": "OK", "sync": "OK"}
    assert _errors_logged(caplog) == []
