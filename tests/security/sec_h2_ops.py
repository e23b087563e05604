"""`frame_scripts`: a client's actions after its preface, one op each. Ops are calm (HTTP/2 a server must
take: valid calls, calls whose gRPC content lies, edited header lists, trailers, resets, SETTINGS, PING,
WINDOW_UPDATE, PRIORITY, unknown frame types) or, one in eight, wild (any stream id, flags, length or value);
fatal ops (CONTINUATION out of place, client GOAWAY, PUSH_PROMISE, random bytes, frames over the size limit
or cut short) end the connection whatever they carry: a script has at most one."""

from __future__ import annotations

import struct
from collections.abc import Callable

from fuzz_proto import grpc_message
from hypothesis import strategies as st
from sec_h2_frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_FRAME_SIZE,
    PADDED,
    PING,
    PRIORITY,
    PRIORITY_FLAG,
    PUSH_PROMISE,
    RST_STREAM,
    WINDOW_UPDATE,
    frame,
)
from sec_h2_strategies import (
    CLIENT_SETTINGS,
    GENERATE,
    PATHS,
    REQUESTS,
    Client,
    Script,
    Step,
    chunked,
    header_block,
    preface,
    request_headers,
    settings_frame,
)

_U32 = st.integers(0, (1 << 32) - 1)
_INCREMENTS = st.sampled_from((0, 1, 65535, (1 << 31) - 1, 1 << 31, (1 << 32) - 1)) | _U32
_SETTING_IDS = st.sampled_from((1, 2, 3, 4, 5, 6, 8, 0, 7, 0xFFFF)) | st.integers(0, 0xFFFF)
_SETTING_VALUES = st.sampled_from((0, 1, 2, 16383, 16384, (1 << 24) - 1, 1 << 24, (1 << 31) - 1, 1 << 31,
                                   (1 << 32) - 1)) | _U32
# Metadata a valid call may carry: deadlines (one that passes at once), a user agent, binary metadata
_CALL_METADATA = ((), (("grpc-timeout", "1n"),), (("grpc-timeout", "5S"),), (("grpc-timeout", "200u"),),
                  (("user-agent", "grpc-go/1.60.0"),), (("x-md-bin", "AAEC"),))


def stream_id(draw: st.DrawFn, client: Client, *, opens: bool, wild: bool) -> int:
    """A stream id: new or one the client opened; `wild`, also 0, even, skipping ahead, huge, with the
    reserved bit set. `opens`: a new id counts as opened (a HEADERS frame), else it is an idle stream's."""
    kinds = ("new", "opened", "zero", "even", "skip", "huge", "reserved") if wild else ("new", "opened")
    # NOTE: calm frames other than HEADERS go to opened streams: most on an idle one are connection errors
    kind = draw(st.sampled_from(kinds)) if opens or wild else "opened"
    if kind == "opened" and client.opened:
        return draw(st.sampled_from(client.opened))
    if kind == "zero":
        return 0
    if kind == "even":
        return 2 * draw(st.integers(1, 50))
    if kind == "huge":
        return draw(st.sampled_from(((1 << 31) - 1, (1 << 32) - 1)))
    if kind == "skip":
        client.next_id += 2 * draw(st.integers(1, 20))
    if not opens:
        return client.next_id  # an idle stream
    new = client.new_id()
    return new | (1 << 31) if kind == "reserved" else new


def _flags(draw: st.DrawFn, wild: bool, *usual: int) -> int:
    """One of the usual flags; `wild`, maybe any (undefined bits too)."""
    return draw(st.sampled_from(usual) | st.integers(0, 255)) if wild else draw(st.sampled_from(usual))


def _sized(draw: st.DrawFn, wild: bool, payload: bytes) -> bytes:
    """The payload; `wild`, maybe cut or extended (a control frame of the wrong length)."""
    if not wild:
        return payload
    change = draw(st.sampled_from((0, -1, 1, -len(payload))))
    return payload[:len(payload) + change] if change <= 0 else payload + b"\0" * change


def _padded(draw: st.DrawFn, wild: bool, body: bytes, flags: int, *, priority: bytes = b"") -> bytes:
    """A DATA/HEADERS payload with the pad length, priority fields and padding its flags call for (`wild`: a
    pad length maybe longer than what follows)."""
    payload = (priority if flags & PRIORITY_FLAG else b"") + body
    if not flags & PADDED:
        return payload
    pad_length = draw(st.integers(0, 255))
    num_padding = min(pad_length, draw(st.sampled_from((pad_length, 0, 1)))) if wild else pad_length
    return bytes([pad_length]) + payload + b"\0" * num_padding


def _priority_fields(draw: st.DrawFn, own_id: int, wild: bool) -> bytes:
    """Exclusive bit + dependency, weight; `wild`: maybe the stream itself as its dependency."""
    dependencies = st.sampled_from((0, own_id, 1)) | _U32 if wild else st.sampled_from((0, 1, 3))
    dependency = draw(dependencies)
    if not wild and dependency == own_id:
        dependency = 0
    return struct.pack(">LB", dependency & 0xFFFFFFFF, draw(st.integers(0, 255)))


def header_frames(draw: st.DrawFn, sid: int, block: bytes, flags: int, *, wild: bool = False) -> list[Step]:
    """A header block as HEADERS and maybe CONTINUATIONs; END_HEADERS (if in `flags`) on the last one."""
    num_parts = draw(st.integers(1, 3)) if len(block) > 2 else 1
    cuts = sorted({draw(st.integers(1, len(block) - 1)) for _ in range(num_parts - 1)})
    parts = [block[a:b] for a, b in zip([0, *cuts], [*cuts, len(block)], strict=True)]
    first = flags if len(parts) == 1 else flags & ~END_HEADERS
    payload = _padded(draw, wild, parts[0], first, priority=_priority_fields(draw, sid, wild))
    steps = [Step(f"HEADERS {first:#x} on {sid}", frame(HEADERS, first, sid, payload))]
    for i, part in enumerate(parts[1:], start=2):
        last_flags = flags & END_HEADERS if i == len(parts) else 0
        continuation = frame(CONTINUATION, last_flags, sid, part)
        steps.append(Step(f"CONTINUATION {last_flags:#x} on {sid}", continuation))
    return steps


def op_call(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    """A gRPC call as real clients send it (HEADERS, DATA+END_STREAM; maybe a deadline or metadata), or with
    its body split, missing, left open or reset; its header block maybe in CONTINUATIONs, padded or with a
    priority."""
    path = draw(st.sampled_from(PATHS))
    sid = client.new_id()
    shape = draw(st.sampled_from(("whole", "whole", "split", "no_body", "open", "reset")))
    flags = END_HEADERS | (END_STREAM if shape == "no_body" else 0)
    flags |= draw(st.sampled_from((0, 0, PADDED, PRIORITY_FLAG)))
    headers = [*request_headers(path), *draw(st.sampled_from(_CALL_METADATA))]
    steps = header_frames(draw, sid, client.encoder.encode(headers), flags)
    if shape == "no_body":
        return steps
    message = grpc_message(REQUESTS[path](draw(st.integers(1, 3))))
    cut = draw(st.integers(1, len(message) - 1)) if shape == "split" else len(message)
    pieces = [piece for piece in (message[:cut], message[cut:]) if piece]
    for i, piece in enumerate(pieces, start=1):
        end = END_STREAM if i == len(pieces) and shape != "open" else 0
        steps.append(Step(f"{path} DATA {end:#x} on {sid}", frame(DATA, end, sid, piece)))
    if shape == "reset":
        steps.append(Step(f"RST_STREAM CANCEL on {sid}", frame(RST_STREAM, 0, sid, struct.pack(">L", 8))))
    return steps


def op_data(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    """DATA whose gRPC message lies: its length, its compressed flag, its bytes, or two messages in a unary
    call; padded (`wild`: with a pad length longer than the frame, any flags)."""
    sid = stream_id(draw, client, opens=False, wild=wild)
    body = draw(st.sampled_from((REQUESTS[GENERATE](1), b"")) | st.binary(max_size=32))
    kind = draw(st.sampled_from(("length", "compressed", "random", "short", "two", "valid")))
    if kind == "length":
        length = len(body) + draw(st.sampled_from((1, -1, 100, MAX_FRAME_SIZE, (1 << 32) - 1 - len(body))))
        data = grpc_message(body, length=max(0, length))
    elif kind == "compressed":
        data = grpc_message(body, is_compressed=draw(st.sampled_from((1, 2, 255))))
    elif kind in ("random", "short"):
        data = draw(st.binary(max_size=48 if kind == "random" else 4))
    else:
        data = grpc_message(body) * (2 if kind == "two" else 1)
    flags = _flags(draw, wild, END_STREAM, 0, END_STREAM | PADDED)
    payload = _padded(draw, wild, data, flags)
    return [Step(f"DATA {kind} {flags:#x} on {sid}", frame(DATA, flags, sid, payload))]


def op_headers(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    """HEADERS with an edited header list (`wild`: random or corrupted bytes) opening a stream, or trailers on
    one the client opened; maybe followed by a valid request body."""
    sid = stream_id(draw, client, opens=True, wild=wild)
    flags = _flags(draw, wild, END_HEADERS, END_HEADERS | END_STREAM)
    steps = header_frames(draw, sid, header_block(draw, client, wild), flags, wild=wild)
    if not flags & END_STREAM and draw(st.booleans()):
        body = grpc_message(REQUESTS[GENERATE](1))
        steps.append(Step(f"Generate DATA on {sid}", frame(DATA, END_STREAM, sid, body)))
    return steps


def op_rst(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    sid = stream_id(draw, client, opens=False, wild=wild)
    code = draw(st.sampled_from((8, 0, 1, 0xFFFFFFFF)) | _U32)
    payload = _sized(draw, wild, struct.pack(">L", code))
    return [Step(f"RST_STREAM {code} on {sid}", frame(RST_STREAM, 0, sid, payload))]


def op_settings(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    """SETTINGS a client may send (an ACK too); `wild`: any ids and values, an ACK with a payload, a length
    not a multiple of 6, a stream id."""
    if not wild:
        pairs = draw(st.lists(st.sampled_from(CLIENT_SETTINGS), max_size=3))
        flags = draw(st.sampled_from((0, 1)))
        return [Step(f"SETTINGS {flags:#x} {pairs}", settings_frame([] if flags else pairs, flags=flags))]
    pairs = draw(st.lists(st.tuples(_SETTING_IDS, _SETTING_VALUES), max_size=4))
    flags = draw(st.sampled_from((0, 1)))
    tail = draw(st.sampled_from((b"", b"\0", b"\0" * 5)))
    sid = draw(st.sampled_from((0, 1, 3)))
    return [Step(f"SETTINGS {flags:#x} {pairs} +{len(tail)} on {sid}",
                 settings_frame(pairs, flags=flags, stream_id=sid, tail=tail))]


def op_ping(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    flags = _flags(draw, wild, 0, 1)
    sid = draw(st.sampled_from((0, 1))) if wild else 0
    payload = _sized(draw, wild, draw(st.binary(min_size=8, max_size=8)))
    return [Step(f"PING {flags:#x} on {sid}", frame(PING, flags, sid, payload))]


def op_window_update(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    """WINDOW_UPDATE on the connection or a stream; `wild`: 0 or overflowing increments, any stream."""
    sid = 0 if draw(st.booleans()) else stream_id(draw, client, opens=False, wild=wild)
    increment = draw(_INCREMENTS if wild else st.integers(1, 1 << 16))
    payload = _sized(draw, wild, struct.pack(">L", increment))
    return [Step(f"WINDOW_UPDATE {increment} on {sid}", frame(WINDOW_UPDATE, 0, sid, payload))]


def op_priority(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    sid = stream_id(draw, client, opens=False, wild=wild)
    payload = _sized(draw, wild, _priority_fields(draw, sid, wild))
    return [Step(f"PRIORITY on {sid}", frame(PRIORITY, 0, sid, payload))]


def op_unknown(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    """Frame types RFC 9113 says to ignore (ORIGIN, PRIORITY_UPDATE too), with any flags; `wild`: ALTSVC (h2
    parses it: a connection error when malformed)."""
    kind = draw(st.sampled_from((0xC, 0x10)) | st.integers(0xA if wild else 0xB, 0xFF))
    sid = draw(st.sampled_from((0, 1, client.next_id)) | _U32)
    flags = draw(st.integers(0, 255))
    return [Step(f"type {kind:#x} on {sid}", frame(kind, flags, sid, draw(st.binary(max_size=32))))]


# Connection errors, whatever their parameters (a script has at most one)
def op_continuation(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    """CONTINUATION where no header block is open."""
    sid = stream_id(draw, client, opens=False, wild=wild)
    flags = _flags(draw, True, END_HEADERS, 0)
    block = header_block(draw, client, wild)
    return [Step(f"CONTINUATION {flags:#x} on {sid}", frame(CONTINUATION, flags, sid, block))]


def op_goaway(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    last_id = draw(st.sampled_from((0, client.next_id, (1 << 31) - 1)) | _U32)
    code = draw(st.sampled_from((0, 2, 11)) | _U32)
    payload = struct.pack(">LL", last_id, code) + draw(st.binary(max_size=8))
    sid = draw(st.sampled_from((0, 1))) if wild else 0
    return [Step(f"GOAWAY last {last_id} on {sid}", frame(GOAWAY, 0, sid, _sized(draw, wild, payload)))]


def op_push_promise(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    sid = stream_id(draw, client, opens=False, wild=wild)
    payload = struct.pack(">L", draw(st.sampled_from((2, 4)) | _U32)) + header_block(draw, client, wild)
    flags = _flags(draw, wild, END_HEADERS)
    return [Step(f"PUSH_PROMISE on {sid}", frame(PUSH_PROMISE, flags, sid, payload))]


def op_raw(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    return [Step("random bytes", draw(st.binary(min_size=1, max_size=32)))]


def op_oversized(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    """A frame header longer than SETTINGS_MAX_FRAME_SIZE, then some of its payload."""
    kind = draw(st.sampled_from((DATA, HEADERS, CONTINUATION, PING, 0x20)))
    sid = stream_id(draw, client, opens=False, wild=wild)
    too_long = MAX_FRAME_SIZE + 1
    length = draw(st.sampled_from((too_long, (1 << 24) - 1)) | st.integers(too_long, (1 << 24) - 1))
    body = b"\0" * draw(st.sampled_from((0, 64, too_long)))
    return [Step(f"type {kind} of {length} bytes on {sid}", frame(kind, 0, sid, body, length=length))]


def op_truncated(draw: st.DrawFn, client: Client, wild: bool) -> list[Step]:
    """A frame whose header promises more than follows (the rest of the script is read as its payload)."""
    kind = draw(st.sampled_from((DATA, HEADERS, PING, WINDOW_UPDATE)))
    sid = stream_id(draw, client, opens=False, wild=wild)
    body = draw(st.binary(max_size=8))
    length = len(body) + draw(st.integers(1, 64))
    return [Step(f"type {kind} cut short on {sid}", frame(kind, 0, sid, body, length=length))]


Op = Callable[[st.DrawFn, Client, bool], list[Step]]
# NOTE: the valid call first: a failing example shrinks towards the calls real clients make
OPS: tuple[Op, ...] = (op_call, op_call, op_call, op_data, op_headers, op_rst, op_settings, op_ping,
                       op_window_update, op_priority, op_unknown)
HEADER_OPS: tuple[Op, ...] = (op_call, op_headers, op_headers, op_headers, op_data, op_rst)
FATAL_OPS: tuple[Op, ...] = (op_continuation, op_goaway, op_push_promise, op_raw, op_oversized, op_truncated)
HEADER_FATAL_OPS: tuple[Op, ...] = (op_continuation, op_push_promise)
# One op in 8 is wild (its stream id, flags, lengths and values anything); it shrinks to calm
_WILD = st.integers(0, 7).map(lambda n: n == 7)


@st.composite
def frame_scripts(draw: st.DrawFn, ops: tuple[Op, ...] = OPS, fatal_ops: tuple[Op, ...] = FATAL_OPS,
                  max_ops: int = 12) -> Script:
    """The preface, then up to `max_ops` client actions and maybe one fatal one among them, in 1 or more
    writes. NOTE: most wild frames end the connection: what a script sends after one is never read, so they
    are rare, and the fatal ones at most one per script."""
    client = Client()
    drawn = draw(st.lists(st.tuples(st.sampled_from(ops), _WILD), min_size=1, max_size=max_ops))
    if not draw(_WILD):  # NOTE: scripts start with a call (their calm frames need an open stream), 1 in 8 not
        drawn.insert(0, (op_call, False))
    fatal = draw(st.none() | st.tuples(st.sampled_from(fatal_ops), _WILD, st.integers(0, len(drawn))))
    if fatal is not None:
        drawn.insert(fatal[2], fatal[:2])
    steps = [draw(preface())]
    for op, wild in drawn:
        steps.extend(op(draw, client, wild))
    # NOTE: half the steps share their write with the next one (real clients write a call at once: what the
    # fast path serves), the others end it, one in four in its middle
    cuts = draw(st.lists(st.sampled_from((0, 0, 1, 2)), min_size=len(steps), max_size=len(steps)))
    return chunked(steps, cuts)
