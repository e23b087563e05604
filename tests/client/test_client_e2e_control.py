"""Both clients against a real engine-server: cancellation, abort, deadlines, errors, unary RPCs."""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_client import (
    AsyncEngineClient,
    ConnectionOptions,
    DeadlineExceededError,
    EngineClient,
    EngineState,
    FinishReason,
    HealthStatus,
    InvalidRequestError,
    ModelTask,
    OverloadedError,
    RetryPolicy,
    StatusCode,
    UnavailableError,
)
from serverproc import RunningServer

LONG_TOKENS = 2000  # far longer than any test waits: the request is still running when the test acts
IDLE_TIMEOUT = 30.0


async def wait_idle(client: AsyncEngineClient) -> None:
    """Poll GetLoad until the engine runs nothing (bounded): the observable effect of a server-side abort."""
    deadline = time.monotonic() + IDLE_TIMEOUT
    while True:
        load = await client.load()
        if load.num_running_requests == 0 and load.num_waiting_requests == 0:
            return
        assert time.monotonic() < deadline, f"requests still running: {load}"
        await asyncio.sleep(0.05)


async def test_leaving_the_iterator_aborts_on_the_server(engine_server: RunningServer) -> None:
    async with AsyncEngineClient(engine_server.target, timeout=60) as client:
        # 1) explicit: the stream's context manager closes the call
        async with client.generate("Once", max_tokens=LONG_TOKENS, ignore_eos=True) as stream:
            async for _ in stream:
                assert (await client.load()).num_running_requests >= 1
                break
        await wait_idle(client)
        # 2) implicit: a bare `break` drops the stream; the event loop finalizes it and cancels the call
        async for _ in client.generate("Twice", max_tokens=LONG_TOKENS, ignore_eos=True):
            break
        await wait_idle(client)
        # 3) task cancellation
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in client.generate("Thrice", max_tokens=LONG_TOKENS, ignore_eos=True):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(client)


def test_sync_break_aborts_on_the_server(engine_server: RunningServer) -> None:
    with EngineClient(engine_server.target, timeout=60) as client:
        for _ in client.generate("Once", max_tokens=LONG_TOKENS, ignore_eos=True):
            break
        deadline = time.monotonic() + IDLE_TIMEOUT
        while client.load().num_running_requests:
            assert time.monotonic() < deadline
            time.sleep(0.05)


async def test_abort_from_another_task(engine_server: RunningServer) -> None:
    async with AsyncEngineClient(engine_server.target, timeout=60) as client:
        stream = client.generate("Abort me", max_tokens=LONG_TOKENS, ignore_eos=True)
        aborter: asyncio.Task[tuple[str, ...]] | None = None
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if aborter is None:
                aborter = asyncio.create_task(client.abort([stream.request_id, "not-in-flight"]))
        assert aborter is not None
        assert await aborter == (stream.request_id,)
        await wait_idle(client)
    assert chunks[-1].finish_reason is FinishReason.ABORT
    assert sum(len(c.token_ids) for c in chunks) < LONG_TOKENS


async def test_deadline_expires_and_the_request_is_aborted(engine_server: RunningServer) -> None:
    async with AsyncEngineClient(engine_server.target) as client:
        with pytest.raises(DeadlineExceededError) as info:
            await client.generate("Slow", request_id="deadline-1", timeout=0.5, max_tokens=LONG_TOKENS,
                                  ignore_eos=True).collect()
        assert info.value.request_id == "deadline-1"
        await wait_idle(client)
    with EngineClient(engine_server.target) as sync_client, pytest.raises(DeadlineExceededError):
        sync_client.complete("Slow", timeout=0.5, max_tokens=LONG_TOKENS, ignore_eos=True)


async def test_server_errors_map_to_the_hierarchy(engine_server: RunningServer) -> None:
    no_retry = ConnectionOptions(engine_server.target, timeout=60, retry=RetryPolicy(max_attempts=1))
    async with AsyncEngineClient(no_retry) as client:
        info = await client.model_info()
        with pytest.raises(InvalidRequestError) as bad_token:
            await client.complete(token_ids=[info.vocab_size + 5], max_tokens=2)
        assert bad_token.value.code is StatusCode.INVALID_ARGUMENT
        with pytest.raises(InvalidRequestError, match="temperature") as bad_temp:
            await client.complete("x", temperature=-1.0, request_id="bad-temp")
        assert bad_temp.value.request_id == "bad-temp"
        with pytest.raises(InvalidRequestError):
            await client.embed("not an embedding model")
        with pytest.raises(OverloadedError) as too_big:  # over the server's 4 MiB receive limit
            await client.complete("x" * (5 * 1024 * 1024), max_tokens=1)
        assert too_big.value.code is StatusCode.RESOURCE_EXHAUSTED
    with EngineClient(no_retry) as sync_client, pytest.raises(InvalidRequestError, match="temperature"):
        sync_client.complete("x", temperature=-1.0)


async def test_closed_port_is_unavailable_after_retries() -> None:
    options = ConnectionOptions("127.0.0.1:9", retry=RetryPolicy(max_attempts=2, initial_backoff=0.01))
    async with AsyncEngineClient(options) as client:
        with pytest.raises(UnavailableError):
            await client.load(timeout=10)


async def test_tokenize_round_trip_and_info(engine_server: RunningServer) -> None:
    text = "Hello world, the quick brown fox!"
    async with AsyncEngineClient(engine_server.target, timeout=60) as client:
        tokens = await client.tokenize(text, return_offsets=True)
        assert await client.detokenize(tokens.token_ids) == text
        plain = await client.tokenize(text, add_special_tokens=False)
        assert plain.token_ids == tokens.token_ids[len(tokens.token_ids) - len(plain.token_ids):]
        assert tokens.offsets is not None
        assert len(tokens.offsets) == len(tokens.token_ids)
        chat = await client.tokenize(messages=[{"role": "user", "content": "Hi"}])
        assert len(chat.token_ids) > 1
        model = await client.model_info()
        assert model.task is ModelTask.GENERATE
        assert model.has_chat_template
        server = await client.server_info()
        assert server.state is EngineState.SERVING
        assert server.api_version == "engine.v1"
        assert await client.health() is HealthStatus.SERVING
        assert await client.health("engine.v1.EngineService") is HealthStatus.SERVING
    with EngineClient(engine_server.target, timeout=60) as sync_client:
        assert sync_client.detokenize(sync_client.tokenize(text).token_ids) == text
        assert sync_client.health() is HealthStatus.SERVING
        assert sync_client.load().state is EngineState.SERVING
