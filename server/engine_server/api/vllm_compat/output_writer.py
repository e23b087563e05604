"""One Generate call's engine outputs -> messages on the wire, written by the engine's output task where it
can (the stream's push sink, as engine.v1's streamed Generate does) and by the handler for what it declines.

NOTE: `ResponseBuilder.on_output` changes the builder's state, so it runs exactly once per output: in `push`,
or in `take` for an output push never built. An output whose messages push could write only in part (a full
flow-control window, paused writes, a message past one frame) is declined with the rest kept here: the
iterator yields that same output next (push is not offered another one before it) and `take` returns the
unwritten messages, so nothing is lost, sent twice or reordered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .responses import EngineRequestFailed, ResponseBuilder

if TYPE_CHECKING:
    from engine_server.api.metrics import RequestTimer
    from engine_server.api.transport.fast_send import FastSender
    from engine_server.frontend.outputs import GenerateOutput


class OutputWriter:
    """Per call: `push` is the stream's sink; the handler sends `take(output)` for each output it is given."""

    __slots__ = ("_builder", "_error", "_held", "_rest", "_sender", "_timer", "is_sending", "on_end")

    def __init__(self, builder: ResponseBuilder, sender: FastSender, timer: RequestTimer | None) -> None:
        self._builder = builder
        self._sender = sender
        self._timer = timer
        self.is_sending = False  # the handler is writing a message itself: push must not overtake it
        self._held: GenerateOutput | None = None  # built by push but not (wholly) written: the handler's now
        self._rest: list[Any] = []  # the held output's messages push did not write
        self._error: EngineRequestFailed | None = None  # what building the held output raised
        self.on_end: Callable[[], None] | None = None  # a call with no task: called once push wrote its end

    def push(self, output: GenerateOutput) -> bool:
        """Writes the output's messages in place (the engine's output task); False: it comes back through
        the iterator (the handler raises an error, or sends what is left)."""
        if self.is_sending or self._held is not None:
            return False
        try:
            messages = self._builder.on_output(output)
        except EngineRequestFailed as exc:
            self._held, self._error = output, exc
            return False
        self._count(output)
        sender = self._sender
        for position, message in enumerate(messages):
            # NOTE: stream=false: the headers are still to go with the one response, so its messages are
            # declined here and leave from the handler through grpclib, as before.
            if not sender.try_send(message):
                self._held, self._rest = output, messages[position:]
                return False
        # NOTE: the call ends with its last message, not once the handler has been woken to end it.
        if output.finished and sender.try_send_ok_trailers() and self.on_end is not None:
            on_end, self.on_end = self.on_end, None
            on_end()
        return True

    def take(self, output: GenerateOutput) -> list[Any]:
        """The messages the handler sends for an output the iterator yielded. Raises EngineRequestFailed."""
        if output is self._held:
            rest, error = self._rest, self._error
            self._held, self._rest, self._error = None, [], None
            if error is not None:
                raise error
            return rest
        messages = self._builder.on_output(output)
        self._count(output)
        return messages

    def _count(self, output: GenerateOutput) -> None:
        timer = self._timer
        if timer is not None:
            timer.on_output(sum(len(chunk.token_ids) for chunk in output.chunks))
