"""One streamed engine.v1 Generate call's responses, from its response headers to its end.

NOTE: the response headers go out at admission, so that every later message can take the push path: the
engine's output task hands each output to `push`, which writes it in place (transport/fast_send.py) without
waking the call's task (one task switch per stream per engine step was the largest cost at 256 streams). What
`push` declines (a full flow-control window, paused writes, an error) comes back through the stream's
iterator, in order, and is sent by the call's task with grpclib's path.

Two ways to run a call: on its task (`await run()`), or with no task at all (`start_without_task`, for
transport/fast_path.py's direct calls): the call then ends in `push`, and asks for a task only when the push
path cannot go on (an output it declined, an error, an end that cannot leave at once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine_server.api import responses
from engine_server.api.errors import RequestFailed
from engine_server.api.stream_limit import StreamSlot
from engine_server.api.transport.fast_send import FastSender

if TYPE_CHECKING:
    from grpclib.server import Stream

    from engine_server.api.handle import OutputStream
    from engine_server.api.metrics import RequestTimer, ServerMetrics
    from engine_server.frontend.outputs import GenerateOutput, GenerateRequest


class StreamedGenerate:
    """The sinks and the consumer loop of one streamed Generate call."""

    __slots__ = (
        "_is_sending", "_metrics", "_num_completion_tokens", "_on_end", "_on_resume", "_outputs", "_plain",
        "_request", "_sender", "_timer",
    )

    def __init__(self, stream: Stream[Any, Any], outputs: OutputStream, request: GenerateRequest,
                 slot: StreamSlot, metrics: ServerMetrics | None) -> None:
        self._outputs = outputs
        self._request = request
        self._metrics = metrics
        self._timer: RequestTimer | None = metrics.request_timer() if metrics is not None else None
        self._num_completion_tokens = [0] * request.params.n
        self._sender = FastSender(stream, before_end=slot.release)
        self._plain = responses.PlainResponses(request.request_id)
        self._is_sending = False  # the task is writing a message itself: push must not overtake it
        self._on_end: Callable[[], None] | None = None  # task-less: the call ended in push
        self._on_resume: Callable[[], None] | None = None  # task-less: the call needs its task now

    # --- task-less ------------------------------------------------------------------------------------

    def start_without_task(self, *, on_end: Callable[[], None], on_resume: Callable[[], None]) -> None:
        """Sends the headers and leaves the call to the sinks: `on_end()` once its end has been written by
        `push`, or `on_resume()` once it needs a task (which then runs `run()`); exactly one of them is
        called, later (never from here: `on_resume` may be called from here)."""
        self._on_end, self._on_resume = on_end, on_resume
        outputs = self._outputs
        if not self._sender.try_send_initial_metadata():
            self._resume()
            return
        outputs.set_sink(self.push, self.push_plain)
        if not outputs.set_ready_callback(self._resume):
            self._resume()

    def detach(self) -> None:
        """The call is over elsewhere (cancelled): no more pushes or calls back."""
        self._on_end = self._on_resume = None
        self._outputs.set_ready_callback(None)
        self._outputs.set_sink(None)

    def _resume(self) -> None:
        on_resume = self._on_resume
        self._on_end = self._on_resume = None
        if on_resume is not None:
            on_resume()

    # --- sinks (the engine's output task) -------------------------------------------------------------

    def push(self, output: GenerateOutput) -> bool:
        if self._is_sending or output.error is not None:
            return False
        num_completion_tokens = self._num_completion_tokens
        sender = self._sender
        payload = self._plain.serialize(output, num_completion_tokens)
        sent = (sender.try_send_serialized(payload) if payload is not None
                else sender.try_send(responses.streaming_response(output, num_completion_tokens)))
        if not sent:
            return False  # NOTE: rebuilding the message later gives the same bytes and counts
        timer = self._timer
        if timer is not None:
            timer.on_output(sum(len(chunk.token_ids) for chunk in output.chunks))
        # NOTE: the call's end leaves with its last message, not once the call's task has been woken to send
        # it (at 256 streams ending together, that wake-up came ~5 ms later for all of them).
        if output.finished and sender.try_send_ok_trailers() and self._on_end is not None:
            on_end = self._on_end
            self.detach()
            self._request_done()
            on_end()
        return True

    def push_plain(self, token_ids: list[int], text: str, num_completion_tokens: int) -> bool:
        """Most messages: plain news, no chunk or GenerateOutput built (outputs.PlainSink)."""
        if self._is_sending:
            return False
        if not self._sender.try_send_serialized(self._plain.serialize_plain(token_ids, text)):
            return False
        self._num_completion_tokens[0] = num_completion_tokens
        timer = self._timer
        if timer is not None:
            timer.on_output(len(token_ids))
        return True

    # --- the call's task ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Streams one message per output the sinks did not take, until the end (headers first, unless
        `start_without_task` sent them)."""
        outputs, sender = self._outputs, self._sender
        if not sender.initial_metadata_sent:
            await sender.send_initial_metadata()
        outputs.set_sink(self.push, self.push_plain)
        timer = self._timer
        num_completion_tokens = self._num_completion_tokens
        try:
            async for output in outputs:
                if output.error is not None:
                    raise RequestFailed(output.error)
                if timer is not None:
                    timer.on_output(sum(len(chunk.token_ids) for chunk in output.chunks))
                self._is_sending = True
                await sender.send(responses.streaming_response(output, num_completion_tokens))
                self._is_sending = False
        finally:
            outputs.set_sink(None)
        sender.try_send_ok_trailers()  # unless push did; else grpclib sends them when the handler returns
        self._request_done()

    def _request_done(self) -> None:
        timer, metrics = self._timer, self._metrics
        if timer is not None and metrics is not None:
            metrics.on_request_done(timer, num_prompt_tokens=len(self._request.prompt_token_ids),
                                    num_completion_tokens=sum(self._num_completion_tokens))
