"""What a hostile or broken HTTP/2 client writes, as Hypothesis strategies: the scripts, the requests and
header lists they carry, and `mutated_streams` (a recorded valid client stream with bytes flipped, inserted,
deleted or cut); sec_h2_ops.py draws frame by frame.

A script is the bytes to write, in chunks (one write each, so the server also reads frames cut between
reads); a failing one shrinks to its shortest form.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine_proto.engine.v1 import generate_pb2, info_pb2, tokenize_pb2
from fuzz_proto import grpc_message
from grpclib.health.v1.health_pb2 import HealthCheckRequest
from h2.config import H2Configuration
from h2.connection import H2Connection
from hpack import Encoder
from hypothesis import strategies as st
from sec_h2_frames import PREFACE, SETTINGS, frame
from sec_raw_h2 import grpc_headers
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

GENERATE = "/engine.v1.EngineService/Generate"
VLLM_GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"


def generate_request(max_tokens: int, *, stream: bool = True) -> bytes:
    request = generate_pb2.GenerateRequest(stream=stream)
    request.token_ids.ids.extend([20, 21, 22])
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    return request.SerializeToString()


def _vllm_request(max_tokens: int) -> bytes:
    return bytes(vllm_pb.GenerateRequest(
        tokenized=vllm_pb.TokenizedInput(input_ids=[20, 21]), stream=True,
        sampling_params=vllm_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    ).SerializeToString())


def _tokenize(n: int) -> bytes:
    return tokenize_pb2.TokenizeRequest(text="hi" * n).SerializeToString()


def _detokenize(n: int) -> bytes:
    return tokenize_pb2.DetokenizeRequest(token_ids=[20] * n).SerializeToString()


def _abort(n: int) -> bytes:
    return generate_pb2.AbortRequest(request_ids=["x"] * n).SerializeToString()


def _empty(n: int) -> bytes:
    return b""


# Methods whose calls end on their own (not Health/Watch), each with a valid request of a given "size" (1-3)
REQUESTS: dict[str, Callable[[int], bytes]] = {
    GENERATE: lambda n: generate_request(n, stream=n % 2 == 1),
    VLLM_GENERATE: _vllm_request,
    "/engine.v1.EngineService/Tokenize": _tokenize,
    "/engine.v1.EngineService/Detokenize": _detokenize,
    "/engine.v1.EngineService/GetLoad": lambda n: info_pb2.GetLoadRequest().SerializeToString(),
    "/engine.v1.EngineService/GetModelInfo": _empty,
    "/engine.v1.EngineService/Abort": _abort,
    "/engine.v1.EngineService/Embed": _empty,
    "/grpc.health.v1.Health/Check": lambda n: HealthCheckRequest().SerializeToString(),
    "/engine.v1.EngineService/NoSuchMethod": _empty,
    "/no.such.Service/Method": _empty,
}
# NOTE: weighted towards the Generate methods: their calls take the fast path (api/transport/fast_path.py)
PATHS = (GENERATE, GENERATE, GENERATE, VLLM_GENERATE, VLLM_GENERATE, *REQUESTS)


def request_headers(path: str) -> list[tuple[str, str]]:
    return grpc_headers(1, path)  # (the server ignores :authority)


@dataclass(frozen=True, slots=True)
class Step:
    what: str  # for the reader of a failing example
    data: bytes


@dataclass(frozen=True, slots=True)
class Script:
    chunks: tuple[tuple[Step, ...], ...]  # each chunk is one write

    @property
    def data(self) -> bytes:
        return b"".join(step.data for chunk in self.chunks for step in chunk)


def chunked(steps: Sequence[Step], cuts: Sequence[int]) -> Script:
    """`cuts[i]`: 0 step i+1 goes into the same write, 1 a write ends after step i, 2 one also ends in its
    middle (a frame cut between reads)."""
    chunks: list[tuple[Step, ...]] = []
    current: list[Step] = []
    for step, cut in zip(steps, cuts, strict=True):
        if cut == 2 and len(step.data) > 1:
            middle = len(step.data) // 2
            chunks.append((*current, Step(step.what + " (1st half)", step.data[:middle])))
            current = [Step(step.what + " (2nd half)", step.data[middle:])]
        else:
            current.append(step)
        if cut:
            chunks.append(tuple(current))
            current = []
    if current:
        chunks.append(tuple(current))
    return Script(tuple(chunks))


class Client:
    """The fuzzing client's books: its next new stream id, the streams it opened and its HPACK encoder (the
    server's decoder mirrors its dynamic table as long as every block it encoded arrives)."""

    def __init__(self) -> None:
        self.encoder = Encoder()
        self.next_id = 1
        self.opened: list[int] = []

    def new_id(self) -> int:
        new = self.next_id
        self.next_id += 2
        self.opened.append(new)
        return new


def settings_frame(pairs: Sequence[tuple[int, int]], *, flags: int = 0, stream_id: int = 0,
                   tail: bytes = b"") -> bytes:
    return frame(SETTINGS, flags, stream_id, b"".join(struct.pack(">HL", *p) for p in pairs) + tail)


# What real clients put in their first SETTINGS (RFC 9113 6.5.2 ids 1-6), all valid
CLIENT_SETTINGS = ((1, 4096), (2, 0), (3, 100), (4, 1 << 22), (5, 1 << 14), (6, 1 << 16), (4, 65535),
                    (5, (1 << 24) - 1), (1, 0), (1, 1 << 16))


@st.composite
def preface(draw: st.DrawFn) -> Step:
    """The connection preface and the client's first SETTINGS."""
    pairs = draw(st.lists(st.sampled_from(CLIENT_SETTINGS), max_size=4))
    return Step(f"preface + SETTINGS {pairs}", PREFACE + settings_frame(pairs))


_HEADER_NAMES = (b":method", b":path", b":scheme", b":authority", b":status", b":protocol", b":x",
                 b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding",
                 b"user-agent", b"authorization", b"x-api-key", b"content-length", b"connection",
                 b"transfer-encoding", b"host", b"x-md-bin", b"Content-Type", b":PATH", b"")
_HEADER_VALUES = (b"POST", b"GET", b"", b"application/grpc", b"application/grpc+json",
                  b"application/grpc+proto", b"application/grpcx", b"text/plain", b"trailers", b"gzip",
                  b"identity", b"1S", b"0m", b"99999999H", b"1n", b"-1S", b"S", b"abc", b"0", b"-1", b"100",
                  b"\x00", b"a\r\nb", b"\xc3\xa9", b"\xff", b"%%%", GENERATE.encode(), b"/", b"*", b"x" * 300)


def _ascii(max_size: int) -> st.SearchStrategy[bytes]:
    return st.text(st.characters(max_codepoint=0x7F), max_size=max_size).map(str.encode)


def _names(wild: bool) -> st.SearchStrategy[bytes]:
    return st.sampled_from(_HEADER_NAMES) | (st.binary(max_size=12) if wild else _ascii(12))


def _values(wild: bool) -> st.SearchStrategy[bytes]:
    values = _HEADER_VALUES if wild else tuple(v for v in _HEADER_VALUES if v.isascii())
    return st.sampled_from(values) | (st.binary(max_size=12) if wild else _ascii(12))


@st.composite
def header_lists(draw: st.DrawFn, wild: bool) -> list[tuple[bytes, bytes]]:
    """A valid request's headers, then 1-4 edits: dropped, duplicated, renamed, revalued, inserted,
    reordered (pseudo-headers last) or upper-cased; `wild`: names and values not ASCII too (the server's
    header encoding: such a block is a connection error)."""
    path = draw(st.sampled_from(PATHS))
    headers = [(name.encode(), value.encode()) for name, value in request_headers(path)]
    for _ in range(draw(st.integers(1, 4))):
        edit = draw(st.sampled_from(("drop", "duplicate", "rename", "revalue", "insert", "reverse", "upper")))
        i = draw(st.integers(0, len(headers) - 1)) if headers else 0
        if edit == "insert" or not headers:
            headers.insert(i, (draw(_names(wild)), draw(_values(wild))))
        elif edit == "drop":
            del headers[i]
        elif edit == "duplicate":
            headers.insert(i, headers[i])
        elif edit == "rename":
            headers[i] = (draw(_names(wild)), headers[i][1])
        elif edit == "revalue":
            headers[i] = (headers[i][0], draw(_values(wild)))
        elif edit == "reverse":
            headers.reverse()
        else:
            headers[i] = (headers[i][0].upper(), headers[i][1])
    return headers


def header_block(draw: st.DrawFn, client: Client, wild: bool) -> bytes:
    """An edited header list (by the client's encoder, or never indexed: the HPACK tables stay in step);
    `wild`, also random bytes or a valid block with a byte flipped."""
    modes = ("edited", "edited_indexed", "random", "flipped") if wild else ("edited", "edited_indexed")
    mode = draw(st.sampled_from(modes))
    if mode == "random":
        return draw(st.binary(min_size=1, max_size=48))
    if mode == "flipped":
        block = bytearray(Encoder().encode([(n, v, True) for n, v in request_headers(GENERATE)]))
        block[draw(st.integers(0, len(block) - 1))] ^= 1 << draw(st.integers(0, 7))
        return bytes(block)
    headers = draw(header_lists(wild))
    if mode == "edited_indexed":
        return client.encoder.encode(headers)
    return Encoder().encode([(n, v, True) for n, v in headers])


def recorded_client_stream(paths: Sequence[str], *, size: int) -> bytes:
    """What h2's own client writes for calls to `paths` (preface, SETTINGS, each call's HEADERS + DATA), a
    PING and a WINDOW_UPDATE: the valid stream that byte mutations start from."""
    conn = H2Connection(H2Configuration(client_side=True))
    conn.initiate_connection()
    for path in paths:
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, request_headers(path))
        conn.send_data(sid, grpc_message(REQUESTS[path](size)), end_stream=True)
    conn.ping(b"fuzzping")
    conn.increment_flow_control_window(1024)
    return conn.data_to_send()


_MUTATIONS = ("flip", "set", "insert", "delete", "duplicate", "truncate")


@st.composite
def mutated_streams(draw: st.DrawFn) -> Script:
    """A recorded valid stream, mutated byte-wise (mostly after the preface), written in random pieces."""
    paths = draw(st.lists(st.sampled_from(PATHS), min_size=1, max_size=4))
    data = bytearray(recorded_client_stream(paths, size=draw(st.integers(1, 3))))
    what = [f"calls to {paths}"]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(_MUTATIONS))
        low = draw(st.sampled_from((len(PREFACE), 0)))
        pos = draw(st.integers(low, len(data) - 1)) if len(data) > low else len(data)
        num = draw(st.integers(1, 8))
        if kind == "flip" and pos < len(data):
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and pos < len(data):
            data[pos] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[pos:pos + num]
        elif kind == "duplicate":
            data[pos:pos] = data[pos:pos + num]
        elif kind == "truncate":
            del data[pos:]
        what.append(f"{kind} at {pos}")
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=4))))
    pieces = [bytes(data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    label = ", ".join(what)
    return Script(tuple((Step(label, piece),) for piece in pieces if piece))
