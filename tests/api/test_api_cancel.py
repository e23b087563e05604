"""Concurrency, cancellation, deadlines and Abort: the engine must end up with nothing running and every KV
block free."""

from __future__ import annotations

import asyncio
import random

import pytest
from apiutil import CALL_TIMEOUT_S, completion_ids, finish_reasons, greedy_request, wait_engine_idle
from engine_proto.engine.v1 import generate_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.const import Status
from grpclib.exceptions import GRPCError

LONG = 1500  # tokens: far more than any test waits for


async def test_64_concurrent_streams_complete(stub: EngineServiceStub) -> None:
    async def one(i: int) -> list[generate_pb2.GenerateResponse]:
        return await stub.Generate(
            greedy_request(text=f"prompt number {i}", max_tokens=16, ignore_eos=True), timeout=CALL_TIMEOUT_S
        )

    results = await asyncio.gather(*(one(i) for i in range(64)))
    assert all(len(completion_ids(r)) == 16 for r in results)
    assert all(finish_reasons(r) == {0: generate_pb2.FINISH_REASON_LENGTH} for r in results)
    # The same prompt alone gives the same tokens as under load (batching does not change greedy output).
    alone = await one(5)
    assert completion_ids(alone) == completion_ids(results[5])


async def test_200_streams_cancelled_at_random_points_free_everything(stub: EngineServiceStub) -> None:
    rng = random.Random(1234)

    async def cancelled_after(num_messages: int) -> None:
        request = greedy_request(text=f"cancel me {num_messages}", max_tokens=LONG, ignore_eos=True)
        async with stub.Generate.open(timeout=CALL_TIMEOUT_S) as call:
            await call.send_message(request, end=True)
            for _ in range(num_messages):
                assert await call.recv_message() is not None
            await call.cancel()

    async def cancelled_task(delay_steps: int) -> None:
        task = asyncio.create_task(
            stub.Generate(
                greedy_request(text="task", max_tokens=LONG, ignore_eos=True), timeout=CALL_TIMEOUT_S
            )
        )
        for _ in range(delay_steps):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    jobs = [
        cancelled_after(rng.randint(0, 6)) if i % 2 else cancelled_task(rng.randint(0, 50))
        for i in range(200)
    ]
    await asyncio.gather(*jobs)
    load = await wait_engine_idle(stub)
    assert load.num_running_requests == 0
    assert load.num_waiting_requests == 0
    assert load.num_free_kv_blocks == load.num_total_kv_blocks
    # And the server still serves.
    after = await stub.Generate(greedy_request(text="still here", max_tokens=4), timeout=CALL_TIMEOUT_S)
    assert completion_ids(after)


async def test_abort_from_another_task_ends_the_stream_with_abort(stub: EngineServiceStub) -> None:
    request = greedy_request(text="abort me", max_tokens=LONG, ignore_eos=True, request_id="abort-me-1")
    responses: list[generate_pb2.GenerateResponse] = []
    async with stub.Generate.open(timeout=CALL_TIMEOUT_S) as call:
        await call.send_message(request, end=True)
        first = await call.recv_message()
        assert first is not None
        responses.append(first)
        aborted = await stub.Abort(
            generate_pb2.AbortRequest(request_ids=["abort-me-1", "unknown"]), timeout=CALL_TIMEOUT_S
        )
        assert list(aborted.aborted_request_ids) == ["abort-me-1"]
        async for message in call:  # ends with status OK, else GRPCError
            responses.append(message)
    assert finish_reasons(responses) == {0: generate_pb2.FINISH_REASON_ABORT}
    assert len(completion_ids(responses)) < LONG
    assert responses[-1].HasField("usage")
    again = await stub.Abort(generate_pb2.AbortRequest(request_ids=["abort-me-1"]), timeout=CALL_TIMEOUT_S)
    assert list(again.aborted_request_ids) == []
    await wait_engine_idle(stub)


async def test_abort_of_a_unary_generate(stub: EngineServiceStub) -> None:
    request = greedy_request(
        text="unary", max_tokens=LONG, ignore_eos=True, request_id="abort-unary", stream=False
    )
    call = asyncio.create_task(stub.Generate(request, timeout=CALL_TIMEOUT_S))
    while not (
        await stub.Abort(generate_pb2.AbortRequest(request_ids=["abort-unary"]), timeout=CALL_TIMEOUT_S)
    ).aborted_request_ids:
        await asyncio.sleep(0.01)  # until the request is admitted (bounded by the call's own deadline)
        assert not call.done()
    responses = await call
    assert len(responses) == 1
    assert finish_reasons(responses) == {0: generate_pb2.FINISH_REASON_ABORT}


async def test_deadline_expiry_aborts_the_request(stub: EngineServiceStub) -> None:
    request = greedy_request(text="deadline", max_tokens=LONG, ignore_eos=True)
    # grpclib's client enforces the deadline itself (TimeoutError) and resets the stream; the server also
    # knows the deadline from the grpc-timeout header. Either way the request must be aborted in the engine.
    with pytest.raises((GRPCError, TimeoutError)) as caught:
        await stub.Generate(request, timeout=0.5)
    if isinstance(caught.value, GRPCError):
        assert caught.value.status == Status.DEADLINE_EXCEEDED
    load = await wait_engine_idle(stub)
    assert load.num_running_requests == 0
    assert load.num_free_kv_blocks == load.num_total_kv_blocks


async def test_duplicate_in_flight_request_id_is_invalid(stub: EngineServiceStub) -> None:
    request = greedy_request(text="dup", max_tokens=LONG, ignore_eos=True, request_id="dup-1")
    async with stub.Generate.open(timeout=CALL_TIMEOUT_S) as call:
        await call.send_message(request, end=True)
        assert await call.recv_message() is not None
        with pytest.raises(GRPCError) as caught:
            await stub.Generate(request, timeout=CALL_TIMEOUT_S)
        assert caught.value.status == Status.INVALID_ARGUMENT
        assert (caught.value.message or "").startswith("request_id:")
        await call.cancel()
    await wait_engine_idle(stub)
