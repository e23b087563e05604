"""The client is never the bottleneck: a 4096-token prompt encodes, and a streamed chunk decodes, fast.

Bounds are generous (10-50x what upb takes on this machine) so the test is stable on a loaded CI box, while a
regression to pure-Python messages (betterproto2 parses a 4096-id request in ~10 ms) would still fail it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine_client import _convert
from engine_client._requests import build_generate_request
from engine_client.params import GenerateParams
from engine_proto.engine.v1 import generate_pb2


def best_of(fn: Callable[[], object], *, repeat: int = 50) -> float:
    """The fastest of `repeat` runs, in seconds (the least noisy estimate of the cost)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def test_4096_token_prompt_encodes_well_under_a_millisecond() -> None:
    prompt = list(range(4096))
    params = GenerateParams(max_tokens=128, temperature=0.0, stop=["\n"], logprobs=1)

    def encode() -> bytes:
        req = build_generate_request(None, token_ids=prompt, messages=None, request_id="r", stream=True,
                                     params=params)
        return req.SerializeToString()

    assert len(encode()) > 4096
    assert best_of(encode) < 2e-3


def test_a_streamed_chunk_decodes_in_microseconds() -> None:
    resp = generate_pb2.GenerateResponse(request_id="0123456789abcdef0123456789abcdef")
    resp.completions.add(index=0, token_ids=[1234], text=" hello")
    data = resp.SerializeToString()

    def decode() -> object:
        return _convert.chunks(generate_pb2.GenerateResponse.FromString(data))

    chunk = _convert.chunks(generate_pb2.GenerateResponse.FromString(data))[0]
    assert chunk.token_ids == (1234,)
    assert best_of(decode, repeat=200) < 100e-6
