"""Keeps `bench/transport_bench.py` from rotting: each of its three transports serves one short stream from
the same real engine (tiny model, core in its own process), and the token ids agree across them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from engine_proto.engine.v1 import generate_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_server.engine.config import EngineConfig
from engine_server.frontend.async_engine import AsyncEngine
from grpclib.client import Channel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from transport_lib.servicers import TRANSPORTS, start_transport

TIMEOUT = 60.0
PROMPT = [16 + (k * 131) % 1000 for k in range(20)]
NUM_TOKENS = 12


async def _one_stream(port: int, request_id: str) -> tuple[list[int], int]:
    """Token ids streamed by the server and the finish reason of the last message."""
    request = generate_pb2.GenerateRequest(request_id=request_id, stream=True)
    request.token_ids.ids.extend(PROMPT)
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = NUM_TOKENS
    request.stopping.ignore_eos = True
    channel = Channel("127.0.0.1", port)
    try:
        replies = await EngineServiceStub(channel).Generate(request, timeout=TIMEOUT)
    finally:
        channel.close()
    token_ids = [t for reply in replies for c in reply.completions for t in c.token_ids]
    return token_ids, replies[-1].completions[-1].finish_reason


async def test_three_transports_stream_the_same_tokens(tiny_model_dir: Path) -> None:
    async with asyncio.timeout(TIMEOUT):
        engine = await AsyncEngine.start(EngineConfig(model=str(tiny_model_dir), num_threads=1))
        try:
            results = {}
            for kind in TRANSPORTS:
                port, stop = await start_transport(kind, engine)
                try:
                    results[kind] = await _one_stream(port, f"smoke-{kind}")
                finally:
                    await stop()
            assert engine.stats().num_running == 0
        finally:
            await engine.shutdown(timeout=5.0)
    reference_ids, reference_finish = results["grpclib-pb2"]
    assert len(reference_ids) == NUM_TOKENS
    assert reference_finish == generate_pb2.FINISH_REASON_LENGTH
    for kind in TRANSPORTS:
        assert results[kind] == (reference_ids, reference_finish), kind
