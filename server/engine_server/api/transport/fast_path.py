"""The buffered-call fast path: grpclib's per-call machinery skipped where its answers are already known.

grpclib runs every call through `request_handler`: header checks, deadline parsing, metadata decoding, the
RecvRequest listener chain (here: the message-size limit of api/transport/limits.py), a receive that awaits
the request through an asyncio.Queue, then the method. For the commonest call (a unary request that is
already complete when its task starts: HEADERS and DATA+END_STREAM arrive together from every gRPC client),
most of that has a known answer: ~20-30 us of the ~240 us a Generate call cost the frontend here (1-token
requests on the simulated engine).

`FastPathHandler` starts every call as grpclib would; a call to a method registered for the fast path that
passes every check below is served here the way request_handler serves it (the same checks and Stream, the
request read from the buffer, the same error -> trailers mapping, deadline and cancellation on reset through
the same wrappers, the same release; the API-key check and the call metrics applied through the
`wrap_method` their listeners also use). Anything unusual (another method, an unknown listener, a request
that is not complete, well-formed and within the size limit, a malformed grpc-timeout, a non-proto content
type) goes to grpclib's request_handler unchanged, which then produces exactly the behaviour and errors it
always did; except for what request_handler mishandles, served here too (its request read by the size limit's
bounded reads): a call with a deadline, which may pass before the call starts or be malformed, or with binary
metadata, which may not be base64 (`_call_to_serve`). A malformed grpc-timeout is INVALID_ARGUMENT on every
path (`_request_deadline`).

Direct calls: for a method registered with a `DirectStart` (engine.v1's streamed Generate), the call's first
step is a loop callback instead of a task, and the method may serve the call from there on without any task
(its messages and end written from the engine's output task): no task, coroutine frames, stream context or
end-of-call wake-up per call. `DirectCall` is the handler's side of such a call: it is ended by the method,
handed a task when the method needs one (then served by `_serve`, as any fast-path call), cancelled on
RST_STREAM or a lost connection, or ended with DEADLINE_EXCEEDED by a timer at its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from grpclib.const import Cardinality, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.events import RecvMessage, RecvRequest
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from grpclib.metadata import Deadline, _Metadata, decode_metadata
from grpclib.protocol import UnackedData
from grpclib.server import Handler, Stream, request_handler
from grpclib.utils import DeadlineWrapper, Wrapper

from engine_server.api.rate_limited_log import RateLimitedLog
from engine_server.api.security.budget import GuardStats
from engine_server.api.transport.call_streams import LeanBuffer
from engine_server.api.transport.limits import MESSAGE_PREFIX, MessageSizeLimit, decode_received

log = logging.getLogger(__name__)

_CONTENT_TYPES = frozenset({"application/grpc", "application/grpc+proto"})
# gRPC's PROTOCOL-HTTP2.md: TimeoutValue (at most 8 ASCII digits) TimeoutUnit; the unit in seconds
_TIMEOUT = re.compile(r"([0-9]{1,8})([HMSmun])")
_TIMEOUT_UNIT_S = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_MAX_ECHOED = 32  # characters of a malformed value repeated in the error message


class FastPathHandler(Handler):
    """grpclib's server Handler; calls to `fast_methods` take the fast path when they qualify."""

    # NOTE: grpclib drops its finished call tasks by walking every task of the connection each 10th call: with
    # 256 calls in flight that was ~26 live tasks looked at per call. Each 256th call keeps the walk to ~2 per
    # call; finished tasks wait a little longer. (Freeing a finished call's objects, most of what this walk's
    # profile shows, costs the same either way.)
    __gc_interval__ = 256

    def __init__(
        self, *args: Any, fast_methods: Collection[str], direct: Mapping[str, DirectStart] | None = None,
        stats: GuardStats | None = None, log_limit: RateLimitedLog | None = None, **kwargs: Any
    ) -> None:
        """`direct`: fast methods (paths) whose calls the given function serves without a task if it can.
        `log_limit`: the server's (a client cancels calls at will: their log lines are rate-limited)."""
        super().__init__(*args, **kwargs)
        self._fast_methods = frozenset(fast_methods)
        self._stats = stats
        self._log_limit = log_limit if log_limit is not None else RateLimitedLog()
        self._size_limit, self._wrappers = _call_listeners(self.dispatch)
        direct_ok = (self._size_limit is not None
                     and all(isinstance(listener, DirectListener) for listener in self._wrappers))
        self._direct_starts = {path: start for path, start in (direct or {}).items()
                               if direct_ok and path in self._fast_methods}
        self._direct: dict[Any, DirectCall] = {}  # calls served without a task (or about to be), by stream

    def accept(self, stream: Any, headers: list[tuple[str, str]], release_stream: Callable[[], Any]) -> None:
        self.__gc_step__()
        headers_map = dict(headers)
        start = self._direct_starts.get(headers_map.get(":path", "")) if self._direct_starts else None
        if start is not None:
            direct = DirectCall(self, stream, headers, release_stream)
            direct.pending = self.loop.call_soon(self._start_direct, direct, headers_map, start)
            self._direct[stream] = direct
            return
        self._tasks[stream] = self.loop.create_task(
            self._handle(stream, headers, headers_map, release_stream)
        )

    def _start_direct(self, direct: DirectCall, headers_map: dict[str, str], start: DirectStart) -> None:
        """A direct call's first step (where a task's would be): served without a task if it qualifies."""
        direct.pending = None
        stream = direct.stream
        taken = self._take_request(stream, direct.headers, headers_map)
        call = None
        if taken is not None:
            method, body, deadline = taken
            admitted, metadata = self._admitted(direct.headers, headers_map[":path"])
            call = self._new_call(stream, headers_map, method, deadline)
            call.metadata = metadata
            # NOTE: a call whose deadline passed already (on arrival, or in a pause before this step) is not
            # started: its task ends it with DEADLINE_EXCEEDED before the engine sees its request (`_handle`)
            if admitted and not _has_passed(deadline):
                direct.call = call
                try:
                    started = start(call, body, direct)
                except Exception:  # NOTE: a bug; the client gets a reset instead of a call that never ends
                    log.exception("Server error")
                    direct.fail()
                    return
                if started:
                    if self._stats is not None:
                        self._stats.num_fast_path_calls += 1
                        self._stats.num_direct_calls += 1
                    if deadline is not None and stream in self._direct:  # (the call may be over already)
                        direct.timer = self.loop.call_later(deadline.time_remaining(), self._expire, direct)
                    return
        del self._direct[stream]
        # NOTE: the call built above (metadata decoded) serves on the task: `start` did nothing with it
        self._tasks[stream] = self.loop.create_task(
            self._handle(stream, direct.headers, headers_map, direct.release_stream, taken, call)
        )

    def _admitted(self, headers: list[tuple[str, str]], path: str) -> tuple[bool, _Metadata | None]:
        """Whether every listener lets the call be served without a task (not so for an invalid API key or
        binary metadata that is not base64: their errors come from the task's path), and the call's metadata
        (None: no listener needed it yet)."""
        if not self._wrappers:
            return True, None
        try:
            metadata = _decoded_metadata(headers)
        except GRPCError:
            return False, None
        return all(listener.admits_direct(path, metadata) for listener in self._wrappers), metadata

    def cancel(self, stream: Any) -> None:
        direct = self._direct.pop(stream, None)
        if direct is None:
            super().cancel(stream)
        else:
            direct.cancel()

    def close(self) -> None:
        directs = list(self._direct.values())
        self._direct.clear()
        for direct in directs:
            direct.cancel()
        super().close()

    def check_closed(self) -> bool:
        return super().check_closed() and not self._direct

    def _continue(self, direct: DirectCall, func: Callable[[Stream[Any, Any]], Awaitable[None]]) -> None:
        """A direct call's task, from where it stopped (the call's deadline, if any, is its task's now)."""
        stream = direct.stream
        if self._direct.pop(stream, None) is None:
            return  # cancelled already
        direct.stop_timer()
        task = self.loop.create_task(self._resume(direct, func))
        # NOTE: a task cancelled before its first step (a reset or the connection's end right after this)
        # never runs `_resume`, which takes over what the call holds (its engine request, stream slot,
        # in-flight count): then `on_cancel` gives it back, as for a call cancelled before it went on a task.
        task.add_done_callback(lambda _: direct.run_on_cancel())
        self._tasks[stream] = task

    def _expire(self, direct: DirectCall) -> None:
        """A direct call's deadline passed: its request is aborted and it ends with DEADLINE_EXCEEDED, as a
        call on a task does (trailers, then RST_STREAM; counted so by the metrics)."""
        direct.timer = None
        if self._direct.get(direct.stream) is not direct:
            return
        direct.run_on_cancel()
        if direct.call is not None:
            direct.call.deadline = None  # NOTE: passed: the task's status comes from _deadline_exceeded
        self._continue(direct, _deadline_exceeded)

    async def _resume(self, direct: DirectCall, func: Callable[[Stream[Any, Any]], Awaitable[None]]) -> None:
        direct.on_cancel = None  # from here `func` gives back what the call holds, cancelled or not
        call = direct.call
        assert call is not None
        await self._serve_and_release(direct.stream, call, direct.headers, func, direct.release_stream)

    def _ended(self, direct: DirectCall, status: Status) -> None:
        self._direct.pop(direct.stream, None)
        direct.stop_timer()
        path = direct.call._method_name if direct.call is not None else ""
        for listener in self._wrappers:
            listener.direct_call_ended(path, status)
        direct.release_stream()

    def _take_request(
        self, stream: Any, headers: list[tuple[str, str]], headers_map: dict[str, str]
    ) -> tuple[Any, bytes, Deadline | None] | None:
        """(method, request, deadline) of a call that qualifies for the fast path, its request read from
        the buffer; else None (nothing read)."""
        path = headers_map.get(":path")
        method = self.mapping.get(path) if path in self._fast_methods else None
        if method is None or self._size_limit is None or not _plain_headers(headers_map, self.codec):
            return None
        try:
            # (the parse walks every header; most calls carry no grpc-timeout at all)
            deadline = _request_deadline(headers) if "grpc-timeout" in headers_map else None
        except GRPCError:  # (`_call_to_serve` answers it)
            return None
        request = _buffered_request(stream, method, self._size_limit.max_receive_message_size)
        return None if request is None else (method, request, deadline)

    async def _handle(
        self, stream: Any, headers: list[tuple[str, str]], headers_map: dict[str, str],
        release_stream: Callable[[], Any], taken: tuple[Any, bytes, Deadline | None] | None = None,
        call: Stream[Any, Any] | None = None,
    ) -> None:
        """A call on its task; `taken` and `call`: its request, and its call object, if made already."""
        if taken is None:
            taken = self._take_request(stream, headers, headers_map)
        if taken is None:
            served_here = self._call_to_serve(stream, headers, headers_map)
            if served_here is not None:
                own_call, method_func = served_here
                await self._serve_and_release(stream, own_call, headers, method_func, release_stream)
                return
            await request_handler(self.mapping, stream, headers, self.codec, self.status_details_codec,
                                  self.dispatch, release_stream)
            return
        method, request, deadline = taken
        if self._stats is not None:
            self._stats.num_fast_path_calls += 1
        if call is None:
            call = self._new_call(stream, headers_map, method, deadline)
        call.recv_message = _Once(call, request)  # type: ignore[method-assign]
        method_func = _deadline_exceeded if _has_passed(deadline) else method.func
        await self._serve_and_release(stream, call, headers, method_func, release_stream)

    async def _serve_and_release(self, stream: Any, call: Stream[Any, Any], headers: list[tuple[str, str]],
                                 method_func: Callable[[Stream[Any, Any]], Awaitable[None]],
                                 release_stream: Callable[[], Any]) -> None:
        try:
            await self._serve(stream, call, headers, method_func)
        except ProtocolError:
            log.exception("Application error")
        except Exception:
            log.exception("Server error")
        finally:
            release_stream()

    def _call_to_serve(
        self, stream: Any, headers: list[tuple[str, str]], headers_map: dict[str, str]
    ) -> tuple[Stream[Any, Any], Callable[[Stream[Any, Any]], Awaitable[None]]] | None:
        """(call, method) for `_serve`, of a call request_handler would mishandle (one with a deadline or
        binary metadata) that passes the checks it makes first (method, content type, te, path), its reads
        bounded as the size limit's listener bounds them; else None (request_handler serves the call).

        NOTE: request_handler starts grpclib's DeadlineWrapper, which raises TimeoutError for a deadline that
        has passed (on arrival, or in a pause before the call's task got there: a GC, a busy loop): "Timeout
        occurred" with a traceback in the log, UNKNOWN for the client (see `_deadline_timer`). It answered a
        malformed grpc-timeout with UNKNOWN and took 9 digits or more (`_request_deadline`). It decodes the
        metadata before it has made the call's Stream: binary metadata that is not base64 was "Server error"
        in the log and a stream never answered (see `_decoded_metadata`).
        """
        has_timeout = "grpc-timeout" in headers_map
        if not has_timeout and not any(name.endswith("-bin") for name, _ in headers):
            return None  # (a call request_handler serves well)
        method = self.mapping.get(headers_map.get(":path", ""))
        if method is None or not _plain_headers(headers_map, self.codec):
            return None
        try:
            deadline = _request_deadline(headers) if has_timeout else None
        except GRPCError as exc:
            # NOTE: answered where request_handler read it (its checks above passed), through the listeners'
            # wrappers (the API key's first); with listeners the fast path cannot apply, through none, as
            # request_handler answered before it ran any
            return self._new_call(stream, headers_map, method, None), _fails_with(exc)
        if self._size_limit is None:
            return None  # (listeners the fast path does not apply)
        if _has_passed(deadline):  # (on arrival: nothing to start)
            return self._new_call(stream, headers_map, method, None), _deadline_exceeded
        bounded = self._size_limit.wrap_method(method.func)
        return self._new_call(stream, headers_map, method, deadline), bounded

    def _new_call(self, stream: Any, headers_map: dict[str, str], method: Any,
                  deadline: Deadline | None) -> Stream[Any, Any]:
        return Stream(
            stream, headers_map[":path"], method.cardinality, method.request_type, method.reply_type,
            codec=self.codec, status_details_codec=self.status_details_codec, dispatch=self.dispatch,
            deadline=deadline, user_agent=headers_map.get("user-agent"),
        )

    async def _serve(self, stream: Any, call: Stream[Any, Any], headers: list[tuple[str, str]],
                     method_func: Callable[[Stream[Any, Any]], Awaitable[None]]) -> None:
        # NOTE: as grpclib's request_handler, for a call whose request was read already (or whose method reads
        # it through the size limit: `_call_to_serve`).
        deadline = call.deadline
        async with call:
            wrapper: Wrapper
            deadline_wrapper: contextlib.AbstractContextManager[Any]
            if deadline is None:
                wrapper = stream.wrapper = Wrapper()
                deadline_wrapper = contextlib.nullcontext()
            else:
                wrapper = stream.wrapper = DeadlineWrapper()
                deadline_wrapper = _deadline_timer(wrapper, deadline)
            try:
                with deadline_wrapper, wrapper:
                    if call.metadata is None:
                        call.metadata = _decoded_metadata(headers)
                    metadata = call.metadata
                    for wrapper_listener in self._wrappers:  # as grpclib's RecvRequest dispatch, in order
                        method_func = wrapper_listener.wrap_method(
                            method_func, method_name=call._method_name, metadata=metadata, peer=call.peer
                        )
                    await method_func(call)
            except GRPCError:
                raise
            except TimeoutError:
                if wrapper.cancel_failed:
                    log.exception("Failed to handle cancellation")
                    raise GRPCError(Status.DEADLINE_EXCEEDED) from None
                if wrapper.cancelled:
                    self._log_limit.log(log, logging.INFO, "calls past their deadline", "Deadline exceeded")
                    raise GRPCError(Status.DEADLINE_EXCEEDED) from None
                log.exception("Timeout occurred")
                raise
            except StreamTerminatedError as err:
                if wrapper.cancel_failed:
                    log.exception("Failed to handle cancellation")
                else:
                    self._log_limit.log(log, logging.INFO, "calls cancelled by their client",
                                        "Request was cancelled: %s", err)
                raise
            except Exception:
                log.exception("Application error")
                raise


@runtime_checkable
class DirectListener(Protocol):
    """A RecvRequest listener that direct calls can apply without a task (besides its `wrap_method`)."""

    def wrap_method(self, method_func: Any, *, method_name: str, metadata: Any, peer: Any) -> Any: ...

    def admits_direct(self, method_name: str, metadata: _Metadata) -> bool:
        """Whether `wrap_method` would leave the call as it is (no side effect)."""
        ...

    def direct_call_ended(self, method_name: str, status: Status) -> None:
        """What `wrap_method`'s wrapper does at the end of a call that ended with `status`."""
        ...


class DirectCall:
    """A fast-path call served without a task of its own, as far as the handler is concerned.

    The method's `DirectStart` gets it, sets `on_cancel`, and later calls exactly one of `end()` (the call
    ended: its trailers were written) or `continue_in_task(func)` (from here a task runs `func(call)` as
    the method's rest, under the fast path's error handling, listeners and release), unless the client
    resets the stream or the connection goes first: then `on_cancel()` is called and the call is over.
    """

    __slots__ = ("_handler", "call", "headers", "on_cancel", "pending", "release_stream", "stream", "timer")

    def __init__(self, handler: FastPathHandler, stream: Any, headers: list[tuple[str, str]],
                 release_stream: Callable[[], Any]) -> None:
        self._handler = handler
        self.stream = stream
        self.headers = headers
        self.release_stream = release_stream
        self.call: Stream[Any, Any] | None = None
        self.pending: asyncio.Handle | None = None  # the first step, not run yet
        self.timer: asyncio.TimerHandle | None = None  # the call's deadline, while it has no task
        self.on_cancel: Callable[[], None] | None = None

    def end(self) -> None:
        self._handler._ended(self, Status.OK)

    def continue_in_task(self, func: Callable[[Stream[Any, Any]], Awaitable[None]]) -> None:
        self._handler._continue(self, func)

    def cancel(self) -> None:
        """The client reset the stream or the connection is gone (the handler forgot this call already)."""
        if self.pending is not None:  # NOTE: as a task cancelled before its first step, but released
            self.pending.cancel()
            self.pending = None
            self.release_stream()
            return
        self.run_on_cancel()
        self._handler._ended(self, Status.CANCELLED)

    def run_on_cancel(self) -> None:
        """The method's `on_cancel`, at most once (its request aborted, what it held given back)."""
        on_cancel, self.on_cancel = self.on_cancel, None
        if on_cancel is not None:
            on_cancel()

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def fail(self) -> None:
        """The start failed unexpectedly: the stream is reset and released."""
        self._handler._direct.pop(self.stream, None)
        with contextlib.suppress(Exception):
            if self.stream.closable:
                self.stream.reset_nowait()
        self.release_stream()


# A method's task-less server: (call, request bytes, DirectCall) -> False if it did nothing (a task serves
# the call then, as any fast-path call).
DirectStart = Callable[[Stream[Any, Any], bytes, DirectCall], bool]


async def _deadline_exceeded(call: Stream[Any, Any]) -> None:
    raise GRPCError(Status.DEADLINE_EXCEEDED)


def _fails_with(error: GRPCError) -> Callable[[Stream[Any, Any]], Awaitable[None]]:
    async def fail(call: Stream[Any, Any]) -> None:
        raise error
    return fail


def _request_deadline(headers: list[tuple[str, str]]) -> Deadline | None:
    """The call's deadline from its grpc-timeout (the earliest of several, as grpclib reads them), or None.

    A value other than 1 to 8 ASCII digits and a unit (H, M, S, m, u, n: gRPC's PROTOCOL-HTTP2.md) is the
    client's error: INVALID_ARGUMENT (the contract's status for a malformed request; grpclib answered UNKNOWN
    and took any number of digits, grpc-go answers INTERNAL, grpc-core ignores the header).
    """
    timeout_s: float | None = None
    for name, value in headers:
        if name != "grpc-timeout":
            continue
        match = _TIMEOUT.fullmatch(value)
        if match is None:
            echoed = value if len(value) <= _MAX_ECHOED else value[:_MAX_ECHOED] + "..."
            raise GRPCError(Status.INVALID_ARGUMENT, f"malformed grpc-timeout {echoed!r}: expected 1 to 8 "
                            "digits and a unit (H, M, S, m, u or n)")
        seconds = int(match[1]) * _TIMEOUT_UNIT_S[match[2]]
        timeout_s = seconds if timeout_s is None else min(timeout_s, seconds)
    return None if timeout_s is None else Deadline.from_timeout(timeout_s)


def _has_passed(deadline: Deadline | None) -> bool:
    return deadline is not None and not deadline.time_remaining()


def _decoded_metadata(headers: list[tuple[str, str]]) -> _Metadata:
    """grpclib's `decode_metadata`; binary metadata (a "-bin" header) that is not base64 is the client's
    error: INVALID_ARGUMENT (grpclib's raises binascii.Error, which no caller expected: see `_call_to_serve`;
    out of a direct call's first step, a loop callback, it left the call unanswered)."""
    try:
        return decode_metadata(headers)
    except ValueError:
        raise GRPCError(Status.INVALID_ARGUMENT, "binary metadata (a -bin header) is not base64") from None


@contextlib.contextmanager
def _deadline_timer(wrapper: DeadlineWrapper, deadline: Deadline) -> Iterator[None]:
    """grpclib's `DeadlineWrapper.start` without its TimeoutError for a deadline that has passed already.

    NOTE: that error leaves before the method runs and before the wrapper counts as cancelled: the call
    ended UNKNOWN with "Timeout occurred" and a traceback in the log, and a direct call's continuation (which
    holds the call's engine request, stream slot and in-flight count: `DirectCall.continue_in_task`) never
    ran, so they were never given back. Here the method starts and is cancelled at its first wait, as when
    the deadline passes while it runs: DEADLINE_EXCEEDED, what it held given back on its way out.
    """
    timer = asyncio.get_running_loop().call_later(
        deadline.time_remaining(), wrapper.cancel, TimeoutError("Deadline exceeded")
    )
    try:
        yield
    finally:
        timer.cancel()


class _Once:
    """`recv_message` of a unary-request call whose request was read already: it, then None.

    NOTE: decoded on the first call, as grpclib decodes in `recv_message`: a malformed request fails inside
    the method (and the listeners' wrappers around it, e.g. the call metrics), as on grpclib's path.
    """

    __slots__ = ("_body", "_call")

    def __init__(self, call: Stream[Any, Any], body: bytes) -> None:
        self._call: Stream[Any, Any] | None = call
        self._body = body

    async def __call__(self) -> Any:
        call, self._call = self._call, None
        if call is None:
            return None
        return decode_received(call, self._body)


def _call_listeners(dispatch: Any) -> tuple[MessageSizeLimit | None, tuple[Any, ...]]:
    """The RecvRequest listeners as the fast path applies them: the size limit (checked on the buffered
    request), and the others (API key, metrics) in order through their `wrap_method`. (None, ()): some
    listener cannot be applied that way (or one listens to RecvMessage), so no call takes the fast path."""
    listeners = dispatch._listeners
    on_request = listeners.get(RecvRequest, [])
    limits = [listener for listener in on_request if isinstance(listener, MessageSizeLimit)]
    wrappers = tuple(listener for listener in on_request if not isinstance(listener, MessageSizeLimit))
    if listeners.get(RecvMessage) or len(limits) != 1 or not all(hasattr(w, "wrap_method") for w in wrappers):
        return None, ()
    return limits[0], wrappers


def _plain_headers(headers: dict[str, str], codec: Any) -> bool:
    return (headers.get(":method") == "POST" and headers.get("content-type") in _CONTENT_TYPES
            and headers.get("te") == "trailers" and type(codec) is ProtoCodec)


def _buffered_request(stream: Any, method: Any, max_size: int) -> bytes | None:
    """The request message's bytes, taken from the stream's buffer (and acknowledged), if the client sent
    exactly one uncompressed message within the size limit and ended the stream; else None (buffer as it
    was)."""
    if method.cardinality not in (Cardinality.UNARY_UNARY, Cardinality.UNARY_STREAM):
        return None
    buffer = stream.buffer
    lean = isinstance(buffer, LeanBuffer) and buffer.items is not None  # (nothing read from it yet)
    if not buffer._eof or (not lean and buffer._acked):
        return None
    # (data, data_size, ack_size) each; the end marker (b"", 0, 0) last
    items: Sequence[UnackedData] = buffer.items if lean else buffer._unacked._queue
    if len(items) == 2 and items[0][2] and not items[1][2]:  # one DATA frame (the usual case)
        data: bytes = items[0][0]
    elif items and not items[-1][2] and all(item[2] for item in itertools.islice(items, len(items) - 1)):
        data = b"".join(item[0] for item in items)
    else:
        return None
    if len(data) < MESSAGE_PREFIX.size:
        return None
    is_compressed, length = MESSAGE_PREFIX.unpack_from(data)
    if is_compressed or length > max_size or len(data) != MESSAGE_PREFIX.size + length:
        return None
    ack = buffer._ack_callback
    taken = buffer.take_all() if lean else [buffer._unacked.get_nowait() for _ in range(len(items))]
    for item in taken:
        if item.ack_size:
            ack(item.ack_size)  # as grpclib's Buffer.read acknowledges what it reads
    return data[MESSAGE_PREFIX.size:]
