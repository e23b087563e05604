"""The async iterator that `AsyncEngine.generate` returns: one request's coalesced outputs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from engine_server.frontend.outputs import GenerateOutput, OutputSink, PlainSink
from engine_server.frontend.request_state import RequestState

if TYPE_CHECKING:
    from engine_server.frontend.async_engine import AsyncEngine


class RequestStream:
    """Yields GenerateOutput until the request finishes; raises the request's error if it fails.

    Each `__anext__` returns everything that became ready since the previous one (coalesced).
    Cancelling a waiting `__anext__`, calling `aclose()`, leaving `async with`, or dropping an unfinished
    stream aborts the request in the engine.
    """

    __slots__ = ("__weakref__", "_engine", "_is_closed", "_state")

    def __init__(self, engine: AsyncEngine, state: RequestState) -> None:
        self._engine = engine
        self._state = state
        self._is_closed = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> RequestStream:
        return self

    def set_sink(self, sink: OutputSink | None, plain_sink: PlainSink | None = None) -> None:
        """Offer each output to `sink(output) -> bool` on the engine's output task before waking the consumer.

        What it declines (False) is yielded here, in order; None: back to yielding everything. `plain_sink`
        (only with a sink) is offered plain news first, as token ids and text alone (outputs.PlainSink).
        """
        state = self._state
        state.sink = sink
        state.plain_sink = plain_sink if sink is not None else None

    def set_ready_callback(self, callback: Callable[[], None] | None) -> bool:
        """Call `callback()` once, instead of waking a consumer, when the stream next has something for one
        (an output the sink declined, an error, the end) while no `__anext__` waits; None: no more calls.

        For a consumer that does not wait in `__anext__` while the sink takes everything (the servicer's
        task-less Generate, api/transport/fast_path.py). False: the stream has something for a consumer
        already (the callback is not kept).
        """
        state = self._state
        if callback is not None and (state.declined or state.has_news or state.error is not None
                                     or state.is_finished or self._is_closed):
            state.on_ready = None
            return False
        state.on_ready = callback
        return True

    async def __anext__(self) -> GenerateOutput:
        state = self._state
        while True:
            if self._is_closed:
                raise StopAsyncIteration
            if state.declined:
                output = state.declined.popleft()
                if output.finished and state.error is None:
                    self._is_closed = True
                return output
            if state.has_news:
                output = state.take()
                if output.finished and state.error is None:
                    self._is_closed = True
                return output
            if state.error is not None:
                self._is_closed = True
                raise state.error
            if state.is_finished:
                self._is_closed = True
                raise StopAsyncIteration
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            state.waiter = waiter
            try:
                await waiter
            except asyncio.CancelledError:
                state.waiter = None
                self._is_closed = True
                self._engine.cancel(state)
                raise

    def close(self) -> None:
        """`aclose()` without awaiting (it never waits)."""
        if not self._is_closed:
            self._is_closed = True
            self._state.on_ready = None
            self._engine.cancel(state=self._state)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # NOTE: a safety net for an API layer that drops a stream without closing it; may run on any thread.
        if not self._is_closed and not self._state.is_finished:
            self._engine.cancel_threadsafe(self._state)
