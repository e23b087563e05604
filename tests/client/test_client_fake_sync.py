"""EngineClient (sync, grpcio) against the in-test fake server: same semantics as the async client."""

from __future__ import annotations

import threading

import pytest
from client_fake_server import FakeServer, fake_text, fake_tokens
from engine_client import (
    ConnectionOptions,
    DeadlineExceededError,
    EngineClient,
    EngineError,
    FinishReason,
    GenerateChunk,
    HealthStatus,
    InvalidRequestError,
    OverloadedError,
    RetryPolicy,
    UnavailableError,
)
from grpclib.const import Status

WAIT = 10.0


def test_streaming_and_request_knobs(fake: FakeServer) -> None:
    with EngineClient(fake.target) as client:
        stream = client.generate("Hi", max_tokens=3, temperature=0.0, stop=["a", "b"], logprobs=0)
        chunks = list(stream)
    req = fake.state.requests[-1]
    assert req.request_id == stream.request_id
    assert req.sampling.HasField("temperature")
    assert req.sampling.temperature == 0.0
    assert list(req.stopping.stop) == ["a", "b"]
    assert req.output.HasField("logprobs")
    expected = fake_tokens([2], 0, 3)
    assert [c.token_ids for c in chunks] == [(t,) for t in expected]
    assert "".join(c.text for c in chunks) == "".join(map(fake_text, expected))
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert all(c.logprobs is not None and c.logprobs[0].token_id == c.token_ids[0] for c in chunks)


def test_complete_n_and_usage(fake: FakeServer) -> None:
    with EngineClient(fake.target) as client:
        result = client.complete(token_ids=[4, 4], max_tokens=2, n=3)
    assert fake.state.requests[-1].stream is False
    assert [c.token_ids for c in result.completions] == [tuple(fake_tokens([4, 4], i, 2)) for i in range(3)]
    assert result.usage is not None
    assert result.usage.completion_tokens == 6


@pytest.mark.parametrize(
    ("status", "error"),
    [(Status.INVALID_ARGUMENT, InvalidRequestError), (Status.RESOURCE_EXHAUSTED, OverloadedError),
     (Status.UNAVAILABLE, UnavailableError)],
)
def test_errors_map_the_same_as_async(fake: FakeServer, status: Status, error: type[EngineError]) -> None:
    fake.state.failures.extend([(status, "nope")] * 2)
    with EngineClient(ConnectionOptions(fake.target, retry=RetryPolicy(max_attempts=1))) as client:
        with pytest.raises(error) as info:
            client.tokenize("x")
        assert info.value.code == status.value
        assert info.value.message == "nope"
        with pytest.raises(error) as gen_info:
            client.complete("x", request_id="r-9")
        assert gen_info.value.request_id == "r-9"


def test_retries_unavailable_but_never_reruns_a_streamed_generate(fake: FakeServer) -> None:
    fake.state.failures.extend([(Status.UNAVAILABLE, "starting")] * 2)
    options = ConnectionOptions(fake.target, retry=RetryPolicy(initial_backoff=0.01))
    with EngineClient(options) as client:
        assert client.model_info().vocab_size == 1000
        assert len(fake.state.requests) == 3
        fake.state.fail_after = (1, Status.UNAVAILABLE)
        seen: list[GenerateChunk] = []

        def consume() -> None:
            seen.extend(client.generate(token_ids=[1], max_tokens=4))

        with pytest.raises(UnavailableError):
            consume()
    assert len(seen) == 1
    assert len(fake.state.requests) == 4


def test_breaking_out_cancels_the_rpc(fake: FakeServer) -> None:
    fake.state.hang_after = 1
    with EngineClient(fake.target) as client:
        for _ in client.generate(token_ids=[1], max_tokens=5):
            break  # the dropped generator is closed at once (refcounting) -> call.cancel()
        assert fake.state.cancelled.wait(WAIT)


def test_deadline_expires(fake: FakeServer) -> None:
    fake.state.hang_after = 0
    with EngineClient(fake.target) as client:
        with pytest.raises(DeadlineExceededError):
            client.generate(token_ids=[1], max_tokens=5, timeout=0.3).collect()
        assert fake.state.cancelled.wait(WAIT)


def test_abort_from_another_thread(fake: FakeServer) -> None:
    fake.state.hang_after = 2
    with EngineClient(fake.target, api_key="k") as client:
        stream = client.generate(token_ids=[1], max_tokens=5)
        aborted: list[tuple[str, ...]] = []

        def abort_when_hanging() -> None:
            if fake.state.hanging.wait(WAIT):
                aborted.append(client.abort(stream.request_id))

        thread = threading.Thread(target=abort_when_hanging)
        thread.start()
        result = stream.collect()
        thread.join(WAIT)
    assert aborted == [(stream.request_id,)]
    assert result.finish_reason is FinishReason.ABORT
    assert len(result.token_ids) == 2
    assert fake.state.metadata[-1]["authorization"] == "Bearer k"


def test_unary_results(fake: FakeServer) -> None:
    with EngineClient(fake.target) as client:
        assert client.health() is HealthStatus.SERVING
        assert client.detokenize(client.tokenize("abc").token_ids) == "abc"
        assert client.embed("xyz").embeddings[0].num_tokens == 3
        assert client.model_info().served_model_name == "fake"
        assert client.load().num_running_requests == 0
        assert client.server_info().limits.max_num_seqs == 8


def test_message_size_limit(fake: FakeServer) -> None:
    client = EngineClient(ConnectionOptions(fake.target, max_send_message_bytes=1000))
    with client, pytest.raises(OverloadedError):
        client.complete(token_ids=list(range(1000)))
    assert fake.state.requests == []


def test_unreachable_server() -> None:
    options = ConnectionOptions("127.0.0.1:1", retry=RetryPolicy(max_attempts=2, initial_backoff=0.01))
    with EngineClient(options) as client, pytest.raises(UnavailableError):
        client.model_info(timeout=5)
