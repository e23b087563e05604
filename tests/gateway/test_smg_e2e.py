"""End to end: the smg gateway (PyPI `smg`) in front of two of our workers, on loopback.

smg detects the workers as vLLM gRPC workers (vllm.grpc.engine.VllmEngine beside engine.v1 on the same port),
serves OpenAI HTTP from them, cancels the way it does (Abort RPC / RST_STREAM), and keeps serving when one
worker dies. Greedy output through smg must equal a direct engine.v1 Generate of the same prompt.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from engine_proto.engine.v1 import engine_service_pb2_grpc, generate_pb2, info_pb2
from serverproc import RunningServer, start_servers
from smgproc import RunningGateway, sse_events, start_gateway
from tokenizers import Tokenizer

MODEL = "tiny"
MAX_TOKENS = 12
HTTP_TIMEOUT_S = 120.0  # two cores shared by two workers, the gateway and other tests
DEADLINE_S = 30.0
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]
PROMPT = "The quick brown fox"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers() -> Iterator[list[RunningServer]]:
    args = ("--served-model-name", MODEL, "--max-num-seqs", "8", "--drain-timeout", "1")
    # One worker with its engine core in a process of its own (the default), one with it on a thread: both
    # cancellation paths are exercised. Their startups overlap (start_servers).
    # One torch thread: two workers, smg and the test share two cores (see BENCHMARKS.md, Engine).
    servers = start_servers(
        2, *args, per_server_args=[(), ("--in-process-engine",)], env={"OMP_NUM_THREADS": "1"}
    )
    try:
        yield servers
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def gateway(workers: list[RunningServer]) -> Iterator[RunningGateway]:
    with start_gateway([w.target for w in workers]) as gw:
        gw.wait_for_workers(2)
        yield gw


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def engine_v1_generate(target: str, request: generate_pb2.GenerateRequest) -> list[int]:
    """A direct engine.v1 Generate (no gateway); the token ids of completion 0."""
    with grpc.insecure_channel(target) as channel:
        stub = engine_service_pb2_grpc.EngineServiceStub(channel)
        ids: list[int] = []
        for response in stub.Generate(request, timeout=HTTP_TIMEOUT_S):
            for chunk in response.completions:
                ids.extend(chunk.token_ids)
        return ids


def reference_request(**input_field: Any) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id=f"ref-{time.monotonic_ns()}", sampling=generate_pb2.SamplingParams(temperature=0.0),
        stopping=generate_pb2.StoppingCriteria(max_tokens=MAX_TOKENS), **input_field,
    )


def completion_reference() -> generate_pb2.GenerateRequest:
    # NOTE: smg's /v1/completions tokenizes the prompt without special tokens (no BOS); so does the reference.
    return reference_request(text=PROMPT, add_special_tokens=False)


def num_in_flight(server: RunningServer) -> int:
    with grpc.insecure_channel(server.target) as channel:
        stub = engine_service_pb2_grpc.EngineServiceStub(channel)
        load = stub.GetLoad(info_pb2.GetLoadRequest(), timeout=10.0).load
        return int(load.num_running_requests + load.num_waiting_requests)


def wait_idle(workers: list[RunningServer], *, timeout: float = DEADLINE_S) -> float:
    """Seconds until no worker has a request in flight (poll with a deadline)."""
    started = time.monotonic()
    while sum(num_in_flight(w) for w in workers):
        if time.monotonic() - started > timeout:
            raise AssertionError(f"workers still busy after {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - started


def gateway_text(gateway: RunningGateway, endpoint: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """(text, finish_reason) of choice 0, streamed or not."""
    url = f"{gateway.url}/v1/{endpoint}"
    is_chat = endpoint == "chat/completions"
    if not body.get("stream"):
        reply = httpx.post(url, json=body, timeout=HTTP_TIMEOUT_S)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        return (choice["message"]["content"] if is_chat else choice["text"]), choice["finish_reason"]
    pieces: list[str] = []
    finish_reason = None
    with httpx.stream("POST", url, json=body, timeout=HTTP_TIMEOUT_S) as reply:
        assert reply.status_code == 200, reply.read()
        for event in sse_events(reply):
            for choice in event["choices"]:
                piece = choice["delta"].get("content") if is_chat else choice.get("text")
                pieces.append(piece or "")
                finish_reason = choice.get("finish_reason") or finish_reason
    return "".join(pieces), finish_reason


def test_gateway_detects_grpc_vllm_workers(gateway: RunningGateway, workers: list[RunningServer]) -> None:
    listed = {w["url"]: w for w in gateway.workers()}
    assert set(listed) == {f"grpc://{w.target}" for w in workers}
    for worker in listed.values():
        assert (worker["connection_mode"], worker["runtime_type"]) == ("grpc", "vllm")
        assert worker["model_id"] == MODEL
        assert worker["is_healthy"]
    models = httpx.get(f"{gateway.url}/v1/models", timeout=10.0).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_engine_v1(
    gateway: RunningGateway, workers: list[RunningServer], tokenizer: Tokenizer, stream: bool
) -> None:
    chat = generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES],
        add_generation_prompt=True,
    )
    expected_ids = engine_v1_generate(workers[0].target, reference_request(chat=chat))
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": stream}
    # Round robin: two requests reach both workers.
    for _ in workers:
        text, finish_reason = gateway_text(gateway, "chat/completions", body)
        assert text == expected
        assert finish_reason == ("length" if len(expected_ids) == MAX_TOKENS else "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_completions_greedy_equals_engine_v1(
    gateway: RunningGateway, workers: list[RunningServer], tokenizer: Tokenizer, stream: bool
) -> None:
    expected_ids = engine_v1_generate(workers[1].target, completion_reference())
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    for _ in workers:
        text, _ = gateway_text(gateway, "completions", body)
        assert text == expected


def test_client_disconnect_mid_stream_leaves_nothing_running(
    gateway: RunningGateway, workers: list[RunningServer]
) -> None:
    """smg turns the disconnect into an Abort RPC (the Generate stream stays open): the worker must stop."""
    wait_idle(workers)
    num_tokens = 2000  # near max_model_len (2048): only an abort ends it within the test's deadline
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": num_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    url = f"{gateway.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=HTTP_TIMEOUT_S) as reply:
        assert reply.status_code == 200
        events = sse_events(reply)
        next(events)
        started = time.monotonic()
        num_events = sum(1 for _, _ in zip(range(5), events, strict=False))
        elapsed = time.monotonic() - started
        assert sum(num_in_flight(w) for w in workers) == 1
    # At the rate just seen, finishing naturally would take this long; the abort must be much faster.
    natural_s = (num_tokens - num_events) * elapsed / num_events
    assert wait_idle(workers, timeout=min(DEADLINE_S, natural_s / 2)) < natural_s / 2


def test_non_streaming_cancel_leaves_nothing_running(
    gateway: RunningGateway, workers: list[RunningServer]
) -> None:
    """A non-streaming request is cancelled by an HTTP/2 reset (grpclib cancels the handler): it stops."""
    wait_idle(workers)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}

    async def start_then_disconnect() -> None:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
            request = asyncio.create_task(client.post(f"{gateway.url}/v1/completions", json=body))
            deadline = time.monotonic() + DEADLINE_S
            while not await asyncio.to_thread(lambda: sum(num_in_flight(w) for w in workers)):
                assert time.monotonic() < deadline, "the request never reached a worker"
                assert not request.done(), request
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(start_then_disconnect())
    wait_idle(workers, timeout=DEADLINE_S)


def test_killing_one_worker_keeps_serving(
    gateway: RunningGateway, workers: list[RunningServer], tokenizer: Tokenizer
) -> None:
    """Runs last in this module: it kills a worker."""
    expected_ids = engine_v1_generate(workers[0].target, completion_reference())
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    workers[1].stop(signal.SIGKILL)
    for _ in range(4):
        text, _ = gateway_text(gateway, "completions", body)
        assert text == expected
    deadline = time.monotonic() + DEADLINE_S
    while any(w["is_healthy"] for w in gateway.workers() if w["url"] == f"grpc://{workers[1].target}"):
        assert time.monotonic() < deadline, "smg never noticed the dead worker"
        time.sleep(0.2)
    for stream in (False, True):
        text, _ = gateway_text(gateway, "completions", {**body, "stream": stream})
        assert text == expected
