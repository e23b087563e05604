"""The vllm.grpc.engine.VllmEngine servicer over a fake engine, on loopback: the gateway's contract."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_server.api.vllm_compat.requests import ENGINE_ID_PREFIX
from engine_server.api.vllm_compat.tokenizer_bundle import build_tokenizer_bundle
from engine_server.frontend.outputs import EngineState
from fake_engine import FAIL_TOKEN, MAX_MODEL_LEN, FakeEngine, expected_tokens
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from vllm_client import VllmClient, read_all

DEADLINE = 10.0


def make_request(
    request_id: str = "r1", *, stream: bool, prompt: tuple[int, ...] = (1, 5, 6), **params: object
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id, tokenized=pb.TokenizedInput(input_ids=prompt), stream=stream,
        sampling_params=pb.SamplingParams(**params),
    )


async def poll(predicate: Callable[[], bool], *, limit_s: float = DEADLINE) -> None:
    """Wait (bounded) until predicate() is true, yielding to the loop between checks."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(0.005)


async def test_stream_sends_every_token_in_a_chunk_then_complete(client: VllmClient) -> None:
    messages = await client.generate_all(make_request(stream=True, max_tokens=5, temperature=0.0))
    kinds = [m.WhichOneof("response") for m in messages]
    assert kinds == ["chunk"] * 5 + ["complete"]
    streamed = [t for m in messages[:-1] for t in m.chunk.token_ids]
    assert streamed == expected_tokens(0, 5)
    assert all(m.chunk.completion_tokens == len(m.chunk.token_ids) for m in messages[:-1])
    assert all(m.chunk.prompt_tokens == 3 for m in messages[:-1])
    complete = messages[-1].complete
    assert complete.finish_reason == "length"
    assert list(complete.output_ids) == expected_tokens(0, 5)
    assert (complete.prompt_tokens, complete.completion_tokens, complete.cached_tokens) == (3, 5, 3)


async def test_non_stream_is_one_complete_with_all_tokens(client: VllmClient) -> None:
    messages = await client.generate_all(make_request(stream=False, max_tokens=4))
    assert [m.WhichOneof("response") for m in messages] == ["complete"]
    assert list(messages[0].complete.output_ids) == expected_tokens(0, 4)
    assert messages[0].complete.completion_tokens == 4


async def test_n_completions(client: VllmClient) -> None:
    messages = await client.generate_all(make_request(stream=False, max_tokens=3, n=2))
    assert [(m.complete.index, list(m.complete.output_ids)) for m in messages] == [
        (0, expected_tokens(0, 3)), (1, expected_tokens(1, 3))]
    messages = await client.generate_all(make_request("r2", stream=True, max_tokens=3, n=2))
    for index in (0, 1):
        mine = [m for m in messages if getattr(m, m.WhichOneof("response")).index == index]
        assert [t for m in mine[:-1] for t in m.chunk.token_ids] == expected_tokens(index, 3)
        assert mine[-1].complete.finish_reason == "length"


async def test_engine_sees_converted_params(client: VllmClient, engine: FakeEngine) -> None:
    await client.generate_all(make_request(
        stream=False, max_tokens=2, top_k=5, min_p=0.1, seed=3, stop_token_ids=[9], logit_bias={4: 1.5},
        stop=["xy"], include_stop_str_in_output=True, skip_special_tokens=True, min_tokens=1,
    ))
    (received,) = engine.received
    assert received.request_id == ENGINE_ID_PREFIX + "r1"
    assert received.prompt_token_ids == (1, 5, 6)
    params = received.params
    # Proto3 zeros mean "default" where zero is not meaningful; `optional` fields keep presence.
    assert (params.temperature, params.top_p, params.repetition_penalty, params.n) == (1.0, 1.0, 1.0, 1)
    assert (params.top_k, params.seed, params.max_tokens, params.min_tokens) == (5, 3, 2, 1)
    assert params.min_p == pytest.approx(0.1)
    assert params.stop_token_ids == (9,)
    assert params.logit_bias == ((4, 1.5),)
    assert received.stop == ("xy",)
    assert received.include_stop_str_in_output
    assert received.detokenize  # stop strings are matched on text


async def test_text_input_and_truncation(client: VllmClient, engine: FakeEngine) -> None:
    request = pb.GenerateRequest(request_id="t", text="abcd", stream=False,
                                 sampling_params=pb.SamplingParams(max_tokens=1, truncate_prompt_tokens=2))
    await client.generate_all(request)
    assert len(engine.received[0].prompt_token_ids) == 2
    assert engine.received[0].detokenize is False


async def test_logprobs(client: VllmClient) -> None:
    request = make_request(stream=True, max_tokens=2, logprobs=2, prompt_logprobs=1)
    messages = await client.generate_all(request)
    first, second, complete = (m for m in messages)
    assert list(first.chunk.output_logprobs.token_ids) == list(first.chunk.token_ids)
    assert [len(t.token_ids) for t in first.chunk.output_logprobs.top_logprobs] == [2]
    # Prompt logprobs ride on the first chunk only; the first prompt token has no value.
    assert list(first.chunk.input_logprobs.token_ids) == [1, 5, 6]
    assert [v.HasField("value") for v in first.chunk.input_logprobs.token_logprobs] == [False, True, True]
    assert not second.chunk.HasField("input_logprobs")
    assert list(complete.complete.output_logprobs.token_ids) == expected_tokens(0, 2)


@pytest.mark.parametrize(("params", "field"), [
    ({"json_schema": ""}, "json_schema"),
    ({"logprobs": -1}, "logprobs"),
    ({"temperature": -1.0}, "temperature"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
async def test_invalid_arguments(client: VllmClient, params: dict[str, Any], field: str) -> None:
    with pytest.raises(GRPCError) as info:
        await client.generate_all(make_request(stream=True, **params))
    assert info.value.status is Status.INVALID_ARGUMENT
    assert field in (info.value.message or "")


async def test_empty_prompt_is_invalid(client: VllmClient) -> None:
    with pytest.raises(GRPCError) as info:
        await client.generate_all(make_request(stream=True, prompt=()))
    assert info.value.status is Status.INVALID_ARGUMENT


async def test_engine_failure_ends_stream_with_internal(client: VllmClient) -> None:
    with pytest.raises(GRPCError) as info:
        await client.generate_all(make_request(stream=True, prompt=(FAIL_TOKEN, 5)))
    assert info.value.status is Status.INTERNAL


async def test_draining_engine_is_unavailable_and_unhealthy(client: VllmClient, engine: FakeEngine) -> None:
    health = await client.unary("HealthCheck", pb.HealthCheckRequest(), pb.HealthCheckResponse)
    assert health.healthy
    engine.state = EngineState.DRAINING
    health = await client.unary("HealthCheck", pb.HealthCheckRequest(), pb.HealthCheckResponse)
    assert not health.healthy
    assert "draining" in health.message
    with pytest.raises(GRPCError) as info:
        await client.generate_all(make_request(stream=True, max_tokens=1))
    assert info.value.status is Status.UNAVAILABLE


async def test_abort_rpc_ends_an_open_stream(client: VllmClient, engine: FakeEngine) -> None:
    """smg's disconnect path: Abort arrives while the Generate stream stays open; the stream must end now."""
    engine.delay = 0.01  # simulated step time; unaborted, the request would run forever (no max_tokens)
    request = make_request("gone", stream=True)
    async with client.generate(request, time_limit=DEADLINE) as stream:
        await stream.send_message(request, end=True)
        first = await stream.recv_message()
        assert first is not None
        assert first.WhichOneof("response") == "chunk"
        await client.abort("gone")
        rest = await asyncio.wait_for(read_all(stream), DEADLINE)
    assert rest[-1].WhichOneof("response") == "complete"
    assert rest[-1].complete.finish_reason == "abort"
    assert all(m.WhichOneof("response") == "chunk" for m in rest[:-1])
    assert not engine.requests
    loads = await client.loads()
    assert (loads.loads[0].num_running_reqs, loads.loads[0].num_waiting_reqs) == (0, 0)


async def test_abort_of_unknown_request_is_ok(client: VllmClient) -> None:
    await client.abort("never-seen")


@pytest.mark.parametrize("stream_mode", [False, True])
async def test_stream_reset_aborts_in_engine(
    client: VllmClient, engine: FakeEngine, stream_mode: bool
) -> None:
    """smg's other path: RST_STREAM (non-streaming requests, or before the first token) -> engine abort."""
    engine.delay = 0.01
    request = make_request("reset", stream=stream_mode)
    async with client.generate(request, time_limit=DEADLINE) as stream:
        await stream.send_message(request, end=True)
        await poll(lambda: engine.num_running == 1)
        await stream.cancel()
    await poll(lambda: not engine.requests)
    assert engine.cancelled == [ENGINE_ID_PREFIX + "reset"]


async def test_get_tokenizer_zip_round_trips(client: VllmClient, tokenizer_dir: Path) -> None:
    chunks = await client.tokenizer_chunks()
    assert len(chunks) > 1  # tokenizer.json is larger than one chunk
    assert all(c.sha256 == "" for c in chunks[:-1])
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = sorted(archive.namelist())
        assert names == ["chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"]
        for name in names:
            assert archive.read(name) == (tokenizer_dir / name).read_bytes()
    # Deterministic: the same files give the same fingerprint.
    assert build_tokenizer_bundle(tokenizer_dir).sha256 == chunks[-1].sha256


async def test_model_and_server_info(client: VllmClient, tokenizer_dir: Path) -> None:
    info = await client.unary("GetModelInfo", pb.GetModelInfoRequest(), pb.GetModelInfoResponse)
    assert info.tokenizer_path == str(tokenizer_dir)
    assert (info.served_model_name, info.model_type, list(info.architectures)) == ("fake", "llama",
                                                                                  ["FakeForCausalLM"])
    assert (info.max_context_length, info.is_generation) == (MAX_MODEL_LEN, True)
    assert list(info.eos_token_ids) == [2]
    assert (info.bos_token_id, info.pad_token_id, info.vocab_size) == (1, 0, 5000)
    server = await client.unary("GetServerInfo", pb.GetServerInfoRequest(), pb.GetServerInfoResponse)
    assert (server.server_type, server.max_num_seqs, server.block_size, server.active_requests) == (
        "vllm-grpc", 8, 16, 0)
    loads = await client.loads()
    assert loads.dp_rank_count == 1
    assert loads.loads[0].token_usage == pytest.approx(0.25)
    assert loads.loads[0].max_total_num_tokens == 64 * 16


async def test_embed(client: VllmClient) -> None:
    reply = await client.unary("Embed", pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(
        input_ids=[1, 2, 3])), pb.EmbedResponse)
    assert (list(reply.embedding), reply.prompt_tokens, reply.embedding_dim) == ([3.0, 0.0, 0.0, 1.0], 3, 4)


async def test_profiling_is_unimplemented(client: VllmClient) -> None:
    with pytest.raises(GRPCError) as info:
        await client.unary("StartProfile", common_pb2.StartProfileRequest(), common_pb2.ProfileResponse)
    assert info.value.status is Status.UNIMPLEMENTED


async def test_flush_cache_waits_for_the_engine_with_timeout_zero(client: VllmClient,
                                                                  engine: FakeEngine) -> None:
    engine.flush_delay = 0.05  # the core finishes its step first
    reply = await client.unary("FlushCache", common_pb2.FlushCacheRequest(timeout_s=0.0),
                               common_pb2.FlushCacheResponse)
    assert reply.success
    assert reply.message == "flushed 7 cached KV blocks"
    assert engine.num_flushes == 1


async def test_flush_cache_past_its_timeout_is_not_a_success(client: VllmClient, engine: FakeEngine) -> None:
    engine.flush_delay = 1.0
    reply = await client.unary("FlushCache", common_pb2.FlushCacheRequest(timeout_s=0.05),
                               common_pb2.FlushCacheResponse)
    assert not reply.success
    assert "did not complete within 0.05 s" in reply.message
    engine.flush_delay = 0.0
    reply = await client.unary("FlushCache", common_pb2.FlushCacheRequest(timeout_s=5.0),
                               common_pb2.FlushCacheResponse)
    assert reply.success


@pytest.mark.parametrize("timeout_s", [-1.0, float("nan"), float("inf")])
async def test_flush_cache_with_a_bad_timeout_is_invalid(client: VllmClient, engine: FakeEngine,
                                                         timeout_s: float) -> None:
    with pytest.raises(GRPCError) as info:
        await client.unary("FlushCache", common_pb2.FlushCacheRequest(timeout_s=timeout_s),
                           common_pb2.FlushCacheResponse)
    assert info.value.status is Status.INVALID_ARGUMENT
    assert "timeout_s" in (info.value.message or "")
    assert engine.num_flushes == 0


async def test_before_the_engine_is_attached() -> None:
    """The server listens while the model loads: unhealthy and UNAVAILABLE until `attach`."""
    from engine_server.api.vllm_compat import VllmEngineServicer
    from grpclib.client import Channel
    from grpclib.server import Server

    is_ready = False
    servicer = VllmEngineServicer(is_ready=lambda: is_ready)
    server = Server([servicer])
    await server.start("127.0.0.1", 0)
    channel = Channel("127.0.0.1", server._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    client = VllmClient(channel)
    try:
        health = await client.unary("HealthCheck", pb.HealthCheckRequest(), pb.HealthCheckResponse)
        assert not health.healthy
        with pytest.raises(GRPCError) as info:
            await client.unary("GetModelInfo", pb.GetModelInfoRequest(), pb.GetModelInfoResponse)
        assert info.value.status is Status.UNAVAILABLE
        servicer.attach(FakeEngine(Path(__file__).parent))
        health = await client.unary("HealthCheck", pb.HealthCheckRequest(), pb.HealthCheckResponse)
        assert not health.healthy  # attached, but the server has not finished warming up
        # warming up (or draining): new work is refused as engine.v1 refuses it, discovery still answers
        with pytest.raises(GRPCError) as info:
            await client.generate_all(make_request("early", stream=False, max_tokens=2))
        assert info.value.status is Status.UNAVAILABLE
        assert "warming up or draining" in str(info.value.message)
        with pytest.raises(GRPCError) as info:
            await client.unary("Embed", pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(
                input_ids=[5])), pb.EmbedResponse)
        assert info.value.status is Status.UNAVAILABLE
        await client.unary("GetModelInfo", pb.GetModelInfoRequest(), pb.GetModelInfoResponse)
        is_ready = True
        health = await client.unary("HealthCheck", pb.HealthCheckRequest(), pb.HealthCheckResponse)
        assert health.healthy
        responses = await client.generate_all(make_request("ready", stream=False, max_tokens=2))
        assert responses[-1].HasField("complete")
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


async def test_wait_idle_returns_once_every_generate_handler_has(engine: FakeEngine) -> None:
    """What a drain waits for before it closes the server: no gateway stream cut before its last message."""
    from engine_server.api.in_flight import InFlight
    from engine_server.api.vllm_compat import VllmEngineServicer
    from grpclib.client import Channel
    from grpclib.server import Server

    engine.delay = 0.01
    in_flight = InFlight()
    servicer = VllmEngineServicer(engine, in_flight=in_flight)
    server = Server([servicer])
    await server.start("127.0.0.1", 0)
    channel = Channel("127.0.0.1", server._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    client = VllmClient(channel)
    try:
        await asyncio.wait_for(in_flight.wait_idle(), DEADLINE)  # nothing in flight: at once
        request = make_request("long", stream=True, max_tokens=20)
        async with client.generate(request, time_limit=DEADLINE) as stream:
            await stream.send_message(request, end=True)
            assert await stream.recv_message() is not None
            assert in_flight.count == 1
            idle = asyncio.ensure_future(in_flight.wait_idle())
            await asyncio.sleep(0.05)
            assert not idle.done()  # the stream still runs
            rest = await asyncio.wait_for(read_all(stream), DEADLINE)
        assert rest[-1].WhichOneof("response") == "complete"
        await asyncio.wait_for(idle, DEADLINE)
        assert in_flight.count == 0
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


async def test_gateway_calls_feed_the_server_metrics(engine: FakeEngine) -> None:
    from engine_server.api.metrics import ServerMetrics
    from engine_server.api.vllm_compat import VllmEngineServicer
    from grpclib.client import Channel
    from grpclib.server import Server

    metrics = ServerMetrics()
    server = Server([VllmEngineServicer(engine, metrics=metrics)])
    await server.start("127.0.0.1", 0)
    channel = Channel("127.0.0.1", server._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    try:
        await VllmClient(channel).generate_all(make_request(stream=True, max_tokens=5, n=2))
    finally:
        channel.close()
        server.close()
        await server.wait_closed()
    assert metrics.registry.get_sample_value("engine_generated_tokens_total") == 10
    assert metrics.registry.get_sample_value("engine_prompt_tokens_total") == 3
    assert metrics.registry.get_sample_value("engine_time_to_first_token_seconds_count") == 1
