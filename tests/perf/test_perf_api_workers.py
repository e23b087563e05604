"""engine-server --api-workers 2: two frontend processes on one port over one engine core process.

Server-wide, whichever process the kernel hands a connection to: the metrics endpoint and the stream limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_proto.engine.v1 import generate_pb2, info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from prometheus_client.parser import text_string_to_metric_families
from serverproc import RunningServer, connection_owner, cpu_seconds, start_server

TIMEOUT = 60.0
MAX_CHANNELS = 32  # new connections until the kernel has handed some to each listener
MAX_STREAMS = 4  # --max-concurrent-streams: small, so that the limit test fills it across both frontends


def _request(request_id: str, *, max_tokens: int) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(request_id=request_id, stream=True)
    request.token_ids.ids.extend([20, 21, 22, 23])
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    return request


async def _tokens(stub: EngineServiceStub, request_id: str, *, max_tokens: int) -> list[int]:
    async with stub.Generate.open(timeout=TIMEOUT) as stream:
        await stream.send_message(_request(request_id, max_tokens=max_tokens), end=True)
        responses = [response async for response in stream]
    return [t for response in responses for c in response.completions for t in c.token_ids]


async def _num_running(stub: EngineServiceStub) -> int:
    load = await stub.GetLoad(info_pb2.GetLoadRequest(), timeout=TIMEOUT)
    return load.load.num_running_requests + load.load.num_waiting_requests


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with start_server("--api-workers", "2", "--max-num-seqs", "8", "--drain-timeout", "5",
                      "--metrics-port", "0", "--max-concurrent-streams", str(MAX_STREAMS)) as running:
        yield running


@contextlib.asynccontextmanager
async def _each_frontend(port: int) -> AsyncIterator[tuple[dict[int, Channel], list[Channel]]]:
    """(serving pid -> a channel it accepted, the other channels opened on the way); all closed at the end."""
    channels: dict[int, Channel] = {}
    spare: list[Channel] = []
    try:
        await _connect_each_frontend(port, channels, spare)
        yield channels, spare
    finally:
        for channel in [*channels.values(), *spare]:
            channel.close()


async def _connect_each_frontend(port: int, channels: dict[int, Channel], spare: list[Channel]) -> None:
    """New connections until both listeners got one: `channels` maps each serving pid to one of them."""
    for _ in range(MAX_CHANNELS):
        channel = Channel("127.0.0.1", port)
        await EngineServiceStub(channel).GetLoad(info_pb2.GetLoadRequest(), timeout=TIMEOUT)
        pid = connection_owner(channel)
        if pid in channels:
            spare.append(channel)
        else:
            channels[pid] = channel
        if len(channels) == 2:
            return
    raise AssertionError("the kernel gave every connection to one frontend")


async def test_two_frontends_one_engine(server: RunningServer) -> None:
    # 1) A connection to each frontend; the same greedy request on each gives the same ids.
    async with asyncio.timeout(TIMEOUT * 2), _each_frontend(server.port) as (channels, _spare):
        assert server.process.pid in channels  # the primary is one of them
        # The worker and the core name themselves (ps, top, the frontend benchmark's CPU split).
        assert len(server.pids_named("engine-api-1")) == 1
        assert len(server.pids_named("engine-core")) == 1
        stubs = [EngineServiceStub(channel) for channel in channels.values()]
        first, second = [await _tokens(stub, "same-id", max_tokens=6) for stub in stubs]
        assert first == second
        assert len(first) == 6

        # 2) Endless streams on both frontends (the same request id: each frontend has its own slice);
        #    GetLoad on either one sees the whole engine.
        streams = []
        for stub in stubs:
            stream = stub.Generate.open(timeout=TIMEOUT)
            await stream.__aenter__()
            await stream.send_message(_request("endless", max_tokens=1500), end=True)
            assert (await stream.recv_message()) is not None
            streams.append(stream)
        assert await _num_running(stubs[0]) == 2
        assert await _num_running(stubs[1]) == 2

        # 3) Abort on the second frontend ends its stream only; cancelling the first's stream aborts it.
        abort = generate_pb2.AbortRequest(request_ids=["endless"])
        aborted = await stubs[1].Abort(abort, timeout=TIMEOUT)
        assert list(aborted.aborted_request_ids) == ["endless"]
        finish = None
        async for response in streams[1]:
            for chunk in response.completions:
                finish = chunk.finish_reason or finish
        assert finish == generate_pb2.FINISH_REASON_ABORT
        await streams[0].cancel()
        for stream in streams:
            await stream.__aexit__(None, None, None)
        # NOTE: polls a counter in another process (the core's next step reports it); bounded above.
        while await _num_running(stubs[0]) != 0:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        assert await _num_running(stubs[1]) == 0


async def test_abort_over_another_connection_reaches_the_other_frontend(server: RunningServer) -> None:
    """A gateway aborts over a connection of its own: the kernel may have given it the other frontend."""
    async with asyncio.timeout(TIMEOUT * 2), _each_frontend(server.port) as (channels, _spare):
        stubs = [EngineServiceStub(channel) for channel in channels.values()]
        # Each frontend in turn runs the stream while the other one receives the Abort.
        for owner, asker in (stubs, stubs[::-1]):
            async with owner.Generate.open(timeout=TIMEOUT) as stream:
                await stream.send_message(_request("cross", max_tokens=1500), end=True)
                assert (await stream.recv_message()) is not None
                aborted = await asker.Abort(generate_pb2.AbortRequest(request_ids=["cross", "unknown"]),
                                            timeout=TIMEOUT)
                assert list(aborted.aborted_request_ids) == ["cross"]
                finish = None
                async for response in stream:
                    for chunk in response.completions:
                        finish = chunk.finish_reason or finish
                assert finish == generate_pb2.FINISH_REASON_ABORT
            # NOTE: polls a counter in another process (the core's next step reports it); bounded above.
            while await _num_running(asker) != 0:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            assert await _num_running(owner) == 0


def _scrape(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]:
    """Every sample of the metrics endpoint; a list per series, so a series reported twice shows."""
    assert server.metrics_port is not None
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        body = response.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault((sample.name, tuple(sorted(sample.labels.items()))), []).append(sample.value)
    return samples


GENERATE_OK = ("engine_requests_total", (("code", "OK"), ("rpc", "Generate")))


async def test_metrics_count_the_requests_of_every_frontend(server: RunningServer) -> None:
    async with asyncio.timeout(TIMEOUT * 2), _each_frontend(server.port) as (channels, spare):
        spare.extend(Channel("127.0.0.1", server.port) for _ in range(max(0, 4 - len(spare))))
        before = await asyncio.to_thread(_scrape, server)
        # Several requests on a connection of each frontend, and on every other connection opened.
        stubs = [EngineServiceStub(channel) for channel in [*channels.values(), *spare]]
        num_requests = 0
        for round_index in range(3):
            for index, stub in enumerate(stubs):
                assert len(await _tokens(stub, f"m-{round_index}-{index}", max_tokens=3)) == 3
                num_requests += 1
        frontends = [*server.pids_named("engine-api-1"), server.process.pid]
        frontend_cpu = sum(map(cpu_seconds, frontends))
        after = await asyncio.to_thread(_scrape, server)

    def delta(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after[(name, labels)][0] - before.get((name, labels), [0.0])[0]

    assert delta(*GENERATE_OK) == num_requests
    assert delta("engine_generated_tokens_total") == 3 * num_requests
    assert delta("engine_prompt_tokens_total") == 4 * num_requests
    assert delta("engine_time_to_first_token_seconds_count") == num_requests
    assert delta("engine_request_duration_seconds_bucket", (("le", "+Inf"),)) == num_requests
    # NOTE: each series once: the engine's gauges come from the primary only, the rest is summed.
    assert all(len(values) == 1 for values in after.values())
    assert ("engine_num_running_requests", ()) in after
    assert ("engine_kv_cache_usage_ratio", ()) in after
    # The frontends' CPU is summed (the primary's own alone is less than both frontends' before the scrape);
    # the core's comes from the primary, which started it.
    assert len(frontends) == 2
    assert after[("process_cpu_seconds_total", ())][0] >= frontend_cpu - 1e-6  # (float rounding of tick sums)
    assert after[("engine_core_process_cpu_seconds_total", ())][0] > 0


async def _open_endless(stub: EngineServiceStub, request_id: str) -> Any:
    """A Generate stream the server has admitted (its first message arrived)."""
    stream = stub.Generate.open(timeout=TIMEOUT)
    await stream.__aenter__()
    await stream.send_message(_request(request_id, max_tokens=1500), end=True)
    try:
        assert (await stream.recv_message()) is not None
    except BaseException:
        await stream.__aexit__(None, None, None)
        raise
    return stream


async def _assert_refused(stub: EngineServiceStub, request_id: str) -> None:
    with pytest.raises(GRPCError) as caught:
        await _open_endless(stub, request_id)
    assert caught.value.status is Status.RESOURCE_EXHAUSTED


async def test_stream_limit_holds_across_frontends(server: RunningServer) -> None:
    streams: list[Any] = []
    async with asyncio.timeout(TIMEOUT * 2), _each_frontend(server.port) as (channels, _spare):
        try:
            primary = EngineServiceStub(channels[server.process.pid])
            worker = next(EngineServiceStub(c) for pid, c in channels.items() if pid != server.process.pid)
            # 1) Half the limit on each frontend: the server is full, whichever process gets the next stream.
            for index in range(MAX_STREAMS // 2):
                streams.append(await _open_endless(primary, f"limit-p{index}"))
                streams.append(await _open_endless(worker, f"limit-w{index}"))
            await _assert_refused(primary, "limit-over-p")
            await _assert_refused(worker, "limit-over-w")
            # 2) A stream that ends on the primary frees a place for the worker.
            abort = generate_pb2.AbortRequest(request_ids=["limit-p0"])
            aborted = await primary.Abort(abort, timeout=TIMEOUT)
            assert list(aborted.aborted_request_ids) == ["limit-p0"]
            ended = streams.pop(0)
            assert [response async for response in ended]  # its last message; then the handler has returned
            await ended.__aexit__(None, None, None)
            streams.append(await _open_endless(worker, "limit-w-again"))
            await _assert_refused(primary, "limit-over-p-again")
        finally:
            for stream in streams:
                await stream.cancel()
                await stream.__aexit__(None, None, None)


def test_sigterm_stops_every_process(server: RunningServer) -> None:
    children = [int(pid) for pid in Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children")
                .read_text().split()]
    assert len(children) >= 2  # the engine core and the worker (spawn may add a resource tracker)
    assert server.stop(signal.SIGTERM) == 0
    # NOTE: a child (e.g. multiprocessing's resource tracker) may still be finishing its exit for a moment
    # after the primary has exited; each must be gone (or a zombie) within a bounded time.
    deadline = time.monotonic() + 10.0
    for pid in children:
        while _is_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _is_alive(pid), f"child {pid} still running after the server stopped"


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"
