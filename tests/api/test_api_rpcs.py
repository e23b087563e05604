"""The non-Generate RPCs, grpcio interop and the metrics endpoint, against the shared server."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import pytest
from apiutil import CALL_TIMEOUT_S, completion_ids, greedy_request
from engine_proto.engine.v1 import embed_pb2, generate_pb2, info_pb2, tokenize_pb2
from engine_proto.engine.v1 import engine_service_pb2_grpc as grpcio_stubs
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.client import Channel
from grpclib.const import Cardinality
from prometheus_client.parser import text_string_to_metric_families
from serverproc import RunningServer, cpu_seconds
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

VLLM_GET_LOADS = "/vllm.grpc.engine.VllmEngine/GetLoads"
TEXT = "héllo wörld, 日本語 text"  # multi-byte characters: offsets count code points, not bytes


async def test_tokenize_offsets_are_code_point_spans(stub: EngineServiceStub) -> None:
    response = await stub.Tokenize(
        tokenize_pb2.TokenizeRequest(text=TEXT, return_offsets=True), timeout=CALL_TIMEOUT_S
    )
    assert len(response.offsets) == len(response.token_ids)
    spans = [(o.start, o.end) for o in response.offsets]
    assert spans[0] == (0, 0)  # BOS: a special token has an empty span
    assert max(end for _, end in spans) == len(TEXT)  # code points (the UTF-8 text is longer in bytes)
    assert all(0 <= start <= end <= len(TEXT) for start, end in spans)
    no_special = await stub.Tokenize(
        tokenize_pb2.TokenizeRequest(text=TEXT, add_special_tokens=False), timeout=CALL_TIMEOUT_S
    )
    assert list(no_special.token_ids) == list(response.token_ids)[1:]
    assert not no_special.offsets


async def test_detokenize_round_trip(stub: EngineServiceStub) -> None:
    ids = (await stub.Tokenize(tokenize_pb2.TokenizeRequest(text=TEXT), timeout=CALL_TIMEOUT_S)).token_ids
    text = await stub.Detokenize(tokenize_pb2.DetokenizeRequest(token_ids=ids), timeout=CALL_TIMEOUT_S)
    assert text.text == TEXT
    raw = await stub.Detokenize(
        tokenize_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=False), timeout=CALL_TIMEOUT_S
    )
    assert raw.text == "<s>" + TEXT


async def test_model_info(stub: EngineServiceStub, server: RunningServer) -> None:
    info = await stub.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.task == info_pb2.MODEL_TASK_GENERATE
    assert info.served_model_name
    assert info.model_path.endswith(info.served_model_name)
    assert info.vocab_size > 0
    assert info.max_context_length > 0
    assert info.special_tokens.HasField("bos_token_id")
    assert list(info.special_tokens.eos_token_ids)
    assert info.has_chat_template
    assert info.dtype == "float32"
    assert info.device == "cpu"
    assert info.embedding_dimension == 0
    assert info.num_parameters > 0


async def test_server_info_and_load(stub: EngineServiceStub) -> None:
    info = await stub.GetServerInfo(info_pb2.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.api_version == "engine.v1"
    assert info.server_version
    assert info.state == info_pb2.ENGINE_STATE_SERVING
    assert info.uptime_seconds > 0
    assert info.limits.max_num_seqs == 64
    assert info.limits.max_receive_message_bytes == 4 << 20
    assert info.limits.kv_block_size > 0
    assert info.limits.max_model_len > 0
    assert info.load.num_total_kv_blocks > 0
    load = await stub.GetLoad(info_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)
    assert load.state == info_pb2.ENGINE_STATE_SERVING
    assert load.load.num_total_kv_blocks == info.load.num_total_kv_blocks


async def _load_when(stub: EngineServiceStub, wanted: tuple[int, int, int]) -> tuple[int, int, int]:
    """(running requests, waiting requests, running completions) once they equal `wanted` (the core reports
    after its next step), or the last seen after a bounded wait."""
    deadline = asyncio.get_running_loop().time() + CALL_TIMEOUT_S
    while True:
        load = (await stub.GetLoad(info_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)).load
        seen = (load.num_running_requests, load.num_waiting_requests, load.num_running_completions)
        if seen == wanted or asyncio.get_running_loop().time() > deadline:
            return seen
        await asyncio.sleep(0.02)


async def test_load_counts_requests_and_completions_apart(stub: EngineServiceStub, channel: Channel,
                                                          server: RunningServer) -> None:
    # One request with n = 8 is one running request with eight running completions, in both services'
    # load reports and in the metrics.
    assert await _load_when(stub, (0, 0, 0)) == (0, 0, 0)
    request = greedy_request([20, 21, 22, 23], max_tokens=1500, ignore_eos=True)
    request.sampling.n = 8
    request.sampling.temperature = 1.0
    async with stub.Generate.open(timeout=CALL_TIMEOUT_S) as stream:
        await stream.send_message(request, end=True)
        assert await stream.recv_message() is not None
        assert await _load_when(stub, (1, 0, 8)) == (1, 0, 8)
        info = await stub.GetServerInfo(info_pb2.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S)
        assert (info.load.num_running_requests, info.load.num_running_completions) == (1, 8)
        async with channel.request(VLLM_GET_LOADS, Cardinality.UNARY_UNARY, vllm_pb.GetLoadsRequest,
                                   vllm_pb.GetLoadsResponse, timeout=CALL_TIMEOUT_S) as call:
            await call.send_message(vllm_pb.GetLoadsRequest(), end=True)
            loads = await call.recv_message()
        assert loads is not None
        assert (loads.loads[0].num_running_reqs, loads.loads[0].num_total_reqs) == (1, 1)
        assert server.metrics_port is not None
        body = await asyncio.to_thread(_fetch, f"http://127.0.0.1:{server.metrics_port}/metrics")
        values = {sample.name: sample.value for family in text_string_to_metric_families(body)
                  for sample in family.samples}
        assert (values["engine_num_running_requests"], values["engine_num_running_completions"]) == (1, 8)
        await stream.cancel()
    assert await _load_when(stub, (0, 0, 0)) == (0, 0, 0)


async def test_embed_on_a_generation_model_is_invalid(stub: EngineServiceStub) -> None:
    from grpclib.const import Status
    from grpclib.exceptions import GRPCError

    request = embed_pb2.EmbedRequest()
    request.inputs.add(text="hello")
    with pytest.raises(GRPCError) as caught:
        await stub.Embed(request, timeout=CALL_TIMEOUT_S)
    assert caught.value.status == Status.INVALID_ARGUMENT
    assert "model" in (caught.value.message or "")


async def test_abort_of_unknown_ids_is_harmless(stub: EngineServiceStub) -> None:
    response = await stub.Abort(generate_pb2.AbortRequest(request_ids=["nope", ""]), timeout=CALL_TIMEOUT_S)
    assert list(response.aborted_request_ids) == []


def test_grpcio_client_interop(server: RunningServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = grpcio_stubs.EngineServiceStub(channel)
        info = stub.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
        assert info.task == info_pb2.MODEL_TASK_GENERATE
        responses = list(
            stub.Generate(greedy_request(text="hi", max_tokens=6, ignore_eos=True), timeout=CALL_TIMEOUT_S)
        )
        assert len(completion_ids(responses)) == 6
        bad = greedy_request(text="hi")
        bad.sampling.top_p = 1.5
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(bad, timeout=CALL_TIMEOUT_S))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith("sampling.top_p:")


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=CALL_TIMEOUT_S) as response:
        return str(response.read().decode())


async def test_metrics_endpoint(stub: EngineServiceStub, server: RunningServer) -> None:
    await stub.Generate(greedy_request(text="metrics", max_tokens=4), timeout=CALL_TIMEOUT_S)
    assert server.metrics_port is not None
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    body = await asyncio.to_thread(_fetch, url)
    assert 'engine_requests_total{code="OK",rpc="Generate"}' in body
    for name in (
        "engine_time_to_first_token_seconds_count",
        "engine_inter_token_latency_seconds_count",
        "engine_request_duration_seconds_count",
        "engine_prompt_tokens_total",
        "engine_generated_tokens_total",
        "engine_num_running_requests",
        "engine_num_waiting_requests",
        "engine_kv_cache_usage_ratio",
    ):
        assert name in body, name
    generated = next(line for line in body.splitlines() if line.startswith("engine_generated_tokens_total"))
    assert float(generated.split()[-1]) >= 4


EPSILON = 1e-6  # seconds: float rounding only (CPU time counts in clock ticks of 10 ms)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
async def test_metrics_report_the_frontend_and_the_engine_core_process_apart(server: RunningServer) -> None:
    """process_* is the frontend's own process, engine_core_process_* the core's: each reads between its
    process's CPU time just before and just after the scrape (the core's would not, were it the frontend's
    own figure or the whole tree's)."""
    assert server.metrics_port is not None
    (core,) = server.pids_named("engine-core")
    frontend = server.process.pid
    before = {frontend: cpu_seconds(frontend), core: cpu_seconds(core)}
    body = await asyncio.to_thread(_fetch, f"http://127.0.0.1:{server.metrics_port}/metrics")
    after = {frontend: cpu_seconds(frontend), core: cpu_seconds(core)}
    values = {sample.name: sample.value for family in text_string_to_metric_families(body)
              for sample in family.samples}
    for name, pid in (("process_cpu_seconds_total", frontend),
                      ("engine_core_process_cpu_seconds_total", core)):
        # (EPSILON: prometheus_client sums utime/ticks + stime/ticks, here (utime + stime)/ticks)
        low, high = before[pid] - EPSILON, after[pid] + EPSILON
        assert low <= values[name] <= high, (name, before, values[name], after)
    assert values["engine_core_process_resident_memory_bytes"] > 0
    assert values["process_resident_memory_bytes"] > 0
