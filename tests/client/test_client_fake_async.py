"""AsyncEngineClient against the in-test fake server: request building, conversion, errors, cancellation."""

from __future__ import annotations

import asyncio

import pytest
from client_fake_server import FakeServer, fake_text, fake_tokens
from engine_client import (
    AsyncEngineClient,
    ConnectionOptions,
    DeadlineExceededError,
    EngineError,
    FinishReason,
    HealthStatus,
    InvalidRequestError,
    OverloadedError,
    RetryPolicy,
    UnavailableError,
)
from grpclib.const import Status

WAIT = 10.0  # bound on every cross-thread wait


async def test_request_knobs_are_sent_and_unset_stays_unset(fake: FakeServer) -> None:
    async with AsyncEngineClient(fake.target) as client:
        stream = client.generate("Hello", max_tokens=3, temperature=0.0, stop="\n", n=2, seed=5,
                                 logit_bias={7: -1.5}, add_special_tokens=False)
        chunks = [c async for c in stream]
    req = fake.state.requests[-1]
    assert req.request_id == stream.request_id
    assert len(stream.request_id) == 32
    assert req.text == "Hello"
    assert req.stream is True
    assert req.add_special_tokens is False
    assert req.sampling.HasField("temperature")
    assert req.sampling.temperature == 0.0
    assert not req.sampling.HasField("top_p")
    assert not req.sampling.HasField("top_k")
    assert req.sampling.n == 2
    assert req.sampling.seed == 5
    assert dict(req.sampling.logit_bias) == {7: -1.5}
    assert list(req.stopping.stop) == ["\n"]
    assert req.stopping.max_tokens == 3
    assert not req.HasField("output")
    assert {c.index for c in chunks} == {0, 1}


async def test_defaults_leave_every_sub_message_unset(fake: FakeServer) -> None:
    async with AsyncEngineClient(fake.target) as client:
        await client.complete(token_ids=[1, 2, 3])
    req = fake.state.requests[-1]
    assert list(req.token_ids.ids) == [1, 2, 3]
    assert req.stream is False
    for name in ("sampling", "stopping", "output", "add_special_tokens"):
        assert not req.HasField(name), name


async def test_streaming_chunks_are_typed_and_usage_is_on_the_last(fake: FakeServer) -> None:
    async with AsyncEngineClient(fake.target) as client:
        chunks = [c async for c in client.generate(token_ids=[5, 6], max_tokens=4)]
    expected = fake_tokens([5, 6], 0, 4)
    assert [c.token_ids for c in chunks] == [(t,) for t in expected]
    assert "".join(c.text for c in chunks) == "".join(map(fake_text, expected))
    assert [c.finish_reason for c in chunks] == [None, None, None, FinishReason.LENGTH]
    assert [c.usage is not None for c in chunks] == [False, False, False, True]
    last_usage = chunks[-1].usage
    assert last_usage is not None
    assert (last_usage.prompt_tokens, last_usage.completion_tokens) == (2, 4)


async def test_complete_collects_n_completions_with_logprobs(fake: FakeServer) -> None:
    async with AsyncEngineClient(fake.target) as client:
        result = await client.complete(token_ids=[9], max_tokens=3, n=2, logprobs=1)
    assert [c.index for c in result.completions] == [0, 1]
    for completion in result.completions:
        assert completion.token_ids == tuple(fake_tokens([9], completion.index, 3))
        assert completion.finish_reason is FinishReason.LENGTH
        assert completion.logprobs is not None
        assert [lp.token_id for lp in completion.logprobs] == list(
            completion.token_ids)
    assert result.text == result.completions[0].text
    assert result.usage is not None
    assert result.usage.completion_tokens == 6


async def test_chat_messages_are_sent_as_chat(fake: FakeServer) -> None:
    async with AsyncEngineClient(fake.target) as client:
        await client.complete(messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    chat = fake.state.requests[-1].chat
    assert [(m.role, m.content) for m in chat.messages] == [("user", "Hi")]
    assert chat.HasField("add_generation_prompt")
    assert chat.add_generation_prompt is False


async def test_exactly_one_input_is_required(fake: FakeServer) -> None:
    async with AsyncEngineClient(fake.target) as client:
        with pytest.raises(ValueError, match="exactly one"):
            client.generate("a", token_ids=[1])
        with pytest.raises(ValueError, match="exactly one"):
            client.generate()
        with pytest.raises(ValueError, match="n must be"):
            client.generate("a", n=0)


@pytest.mark.parametrize(
    ("status", "error"),
    [(Status.INVALID_ARGUMENT, InvalidRequestError), (Status.RESOURCE_EXHAUSTED, OverloadedError),
     (Status.UNAVAILABLE, UnavailableError), (Status.DEADLINE_EXCEEDED, DeadlineExceededError)],
)
async def test_generate_errors_carry_code_message_and_request_id(fake: FakeServer, status: Status,
                                                                 error: type[EngineError]) -> None:
    fake.state.failures.extend([(status, "bad thing")] * 3)
    options = ConnectionOptions(fake.target, retry=RetryPolicy(max_attempts=1))
    async with AsyncEngineClient(options) as client:
        stream = client.generate("x", request_id="rid-1")
        with pytest.raises(error) as info:
            await stream.collect()
    assert info.value.code == status.value
    assert info.value.message == "bad thing"
    assert info.value.request_id == "rid-1"


async def test_unavailable_is_retried_for_unary_and_not_started_generate(fake: FakeServer) -> None:
    fake.state.failures.extend([(Status.UNAVAILABLE, "starting")] * 2)
    options = ConnectionOptions(fake.target, retry=RetryPolicy(max_attempts=3, initial_backoff=0.01))
    async with AsyncEngineClient(options) as client:
        assert (await client.model_info()).served_model_name == "fake"
        assert len(fake.state.requests) == 3
        fake.state.failures.append((Status.UNAVAILABLE, "starting"))
        result = await client.complete(token_ids=[1], max_tokens=2)
    assert result.token_ids == tuple(fake_tokens([1], 0, 2))
    assert len(fake.state.requests) == 5


async def test_a_generate_that_streamed_output_is_never_rerun(fake: FakeServer) -> None:
    fake.state.fail_after = (2, Status.UNAVAILABLE)
    async with AsyncEngineClient(fake.target) as client:
        seen = []

        async def consume() -> None:
            async for chunk in client.generate(token_ids=[1], max_tokens=5):
                seen.append(chunk)

        with pytest.raises(UnavailableError):
            await consume()
    assert len(seen) == 2
    assert len(fake.state.requests) == 1


async def test_leaving_the_stream_cancels_the_rpc(fake: FakeServer) -> None:
    fake.state.hang_after = 1
    async with AsyncEngineClient(fake.target) as client:
        async with client.generate(token_ids=[1], max_tokens=5) as stream:
            async for _ in stream:
                break
        assert await asyncio.to_thread(fake.state.cancelled.wait, WAIT)


async def test_task_cancellation_cancels_the_rpc(fake: FakeServer) -> None:
    fake.state.hang_after = 0
    async with AsyncEngineClient(fake.target) as client:

        async def consume() -> None:
            async for _ in client.generate(token_ids=[1], max_tokens=5):
                pass

        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(fake.state.hanging.wait, WAIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(fake.state.cancelled.wait, WAIT)


async def test_deadline_expires_and_cancels(fake: FakeServer) -> None:
    fake.state.hang_after = 0
    async with AsyncEngineClient(fake.target, timeout=0.3) as client:
        with pytest.raises(DeadlineExceededError) as info:
            await client.generate(token_ids=[1], max_tokens=5, request_id="slow").collect()
        assert info.value.request_id == "slow"
        assert await asyncio.to_thread(fake.state.cancelled.wait, WAIT)


async def test_abort_from_another_task_ends_the_stream_with_abort(fake: FakeServer) -> None:
    fake.state.hang_after = 1
    async with AsyncEngineClient(fake.target) as client:
        stream = client.generate(token_ids=[1], max_tokens=5)
        collecting = asyncio.create_task(stream.collect())
        assert await asyncio.to_thread(fake.state.hanging.wait, WAIT)
        assert await client.abort(stream.request_id) == (stream.request_id,)
        result = await asyncio.wait_for(collecting, WAIT)
        assert await client.abort(["unknown"]) == ()
    assert result.finish_reason is FinishReason.ABORT
    assert len(result.token_ids) == 1


async def test_api_key_is_sent_as_bearer_metadata(fake: FakeServer) -> None:
    async with AsyncEngineClient(fake.target, api_key="s3cret") as client:
        await client.load()
    assert fake.state.metadata[-1]["authorization"] == "Bearer s3cret"


async def test_unary_calls_convert_to_typed_results(fake: FakeServer) -> None:
    async with AsyncEngineClient(fake.target) as client:
        assert await client.health() is HealthStatus.SERVING
        tok = await client.tokenize("héllo", return_offsets=True)
        assert tok.token_ids == tuple(map(ord, "héllo"))
        assert tok.offsets is not None
        assert tok.offsets[1] == (1, 2)
        assert await client.detokenize(tok.token_ids) == "héllo"
        emb = await client.embed(["ab", [1, 2, 3]])
        assert [e.num_tokens for e in emb.embeddings] == [2, 3]
        assert emb.vectors[1] == [3.0, 0.5, -0.5]
        info = await client.model_info()
        special = (info.bos_token_id, info.pad_token_id, info.eos_token_ids)
        assert info.vocab_size == 1000
        assert special == (0, None, (999,))
        server = await client.server_info()
        assert server.api_version == "engine.v1"
        assert server.state.value == "serving"


async def test_message_size_limit_is_enforced_client_side(fake: FakeServer) -> None:
    options = ConnectionOptions(fake.target, max_send_message_bytes=1000)
    async with AsyncEngineClient(options) as client:
        with pytest.raises(OverloadedError, match="max_send_message_bytes"):
            await client.complete(token_ids=list(range(1000)))
    assert fake.state.requests == []


async def test_unreachable_server_is_unavailable_after_retries() -> None:
    options = ConnectionOptions("127.0.0.1:1", retry=RetryPolicy(max_attempts=2, initial_backoff=0.01))
    async with AsyncEngineClient(options) as client:
        with pytest.raises(UnavailableError):
            await client.load()
