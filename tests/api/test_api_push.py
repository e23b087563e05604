"""The servicer's push path (an engine stream that hands each output to the stream's sink, as AsyncEngine's
RequestState does): messages and the call's end leave from the push itself, without waking the handler."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import apiutil
from apiutil import CALL_TIMEOUT_S, greedy_request
from engine_server.api.config import ServerConfig
from engine_server.api.handle import EngineHandle
from engine_server.api.server import EngineServer
from engine_server.engine.config import EngineConfig
from engine_server.engine.types import FinishReason
from engine_server.frontend.outputs import CompletionChunk, GenerateOutput, GenerateRequest, PlainSink
from fakes import FakeEngine

NUM_TOKENS = 3


class PushingStream:
    """Pushes NUM_TOKENS outputs (the last one finished) into the sink once it is set, then keeps the
    handler's iterator waiting until `release` is set (a handler that had to wake up to end the call would
    hang the client until then)."""

    def __init__(self, request: GenerateRequest, release: asyncio.Event) -> None:
        self._request = request
        self._release = release
        self.delivered: list[bool] = []
        self.num_plain = 0  # outputs the plain sink took (as the chunk alone)

    def __aiter__(self) -> PushingStream:
        return self

    def set_sink(self, sink: Callable[[GenerateOutput], bool] | None,
                 plain_sink: PlainSink | None = None) -> None:
        if sink is not None:
            asyncio.get_running_loop().call_soon(self._push_all, sink, plain_sink)

    def _push_all(self, sink: Callable[[GenerateOutput], bool],
                  plain_sink: PlainSink | None) -> None:
        for step in range(1, NUM_TOKENS + 1):
            finish = FinishReason.LENGTH if step == NUM_TOKENS else None
            chunk = CompletionChunk(0, [10 + step], "", None, finish, None, step)
            # (as RequestState offers it)
            if finish is None and plain_sink is not None and plain_sink([10 + step], "", step):
                self.num_plain += 1
                self.delivered.append(True)
                continue
            output = GenerateOutput(self._request.request_id, [chunk], 2, 0, None, finish is not None)
            self.delivered.append(sink(output))

    async def __anext__(self) -> GenerateOutput:
        await self._release.wait()
        raise StopAsyncIteration

    def set_ready_callback(self, callback: Callable[[], None] | None) -> bool:
        return True  # never called back: every output is taken by the sinks

    async def aclose(self) -> None:
        pass

    def close(self) -> None:
        pass


class PushingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.streams: list[PushingStream] = []

    def generate(self, request: GenerateRequest) -> Any:
        if request.request_id.startswith("warmup-"):  # the server's own warm-up request at start
            return super().generate(request)
        stream = PushingStream(request, self.release)
        self.streams.append(stream)
        return stream


async def test_the_last_pushed_message_ends_the_call_without_waking_the_handler() -> None:
    engine = PushingEngine()

    async def start_engine() -> EngineHandle:
        return engine

    config = ServerConfig(port=0, drain_timeout_s=5.0)
    server = EngineServer(config, engine_config=EngineConfig(model="/fake"), start_engine=start_engine)
    await server.start()
    harness = apiutil.Harness(server, engine)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            # the handler is still parked in its iterator (release not set) when the client sees the end
            async with harness.stub.Generate.open() as call:
                await call.send_message(greedy_request([5, 6], max_tokens=NUM_TOKENS), end=True)
                responses = [response async for response in call]
                await call.recv_trailing_metadata()
            assert [list(r.completions[0].token_ids) for r in responses] == [[11], [12], [13]]
            assert responses[-1].completions[0].finish_reason == 2  # FINISH_REASON_LENGTH
            assert responses[-1].usage.completion_tokens == NUM_TOKENS
            assert engine.streams[0].delivered == [True] * NUM_TOKENS
            assert engine.streams[0].num_plain == NUM_TOKENS - 1  # all but the last: plain chunks
            assert not engine.release.is_set()
    finally:
        engine.release.set()  # the handler finishes quietly (the call had ended OK)
        harness.channel.close()
        await server.close()
