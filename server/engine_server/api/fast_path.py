"""The buffered-call fast path: grpclib's per-call machinery skipped where its answers are already known.

grpclib runs every call through `request_handler`: header checks, deadline parsing, metadata decoding, the
RecvRequest listener chain (here: the message-size limit of api/security/limits.py), a receive that awaits
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
always did.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Collection
from typing import Any

from grpclib.const import Cardinality, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.events import RecvMessage, RecvRequest
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from grpclib.metadata import Deadline, decode_metadata
from grpclib.server import Handler, Stream, request_handler
from grpclib.utils import DeadlineWrapper, Wrapper

from engine_server.api.security.budget import GuardStats
from engine_server.api.security.limits import MESSAGE_PREFIX, MessageSizeLimit, decode_received

log = logging.getLogger(__name__)

_CONTENT_TYPES = frozenset({"application/grpc", "application/grpc+proto"})


class FastPathHandler(Handler):
    """grpclib's server Handler; calls to `fast_methods` take the fast path when they qualify."""

    # NOTE: grpclib drops its finished call tasks by walking every task of the connection each 10th call: with
    # 256 calls in flight that was ~26 live tasks looked at per call. Each 256th call keeps the walk to ~2 per
    # call; finished tasks wait a little longer. (Freeing a finished call's objects, most of what this walk's
    # profile shows, costs the same either way.)
    __gc_interval__ = 256

    def __init__(
        self, *args: Any, fast_methods: Collection[str], stats: GuardStats | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._fast_methods = frozenset(fast_methods)
        self._stats = stats
        self._size_limit, self._wrappers = _call_listeners(self.dispatch)

    def accept(self, stream: Any, headers: list[tuple[str, str]], release_stream: Callable[[], Any]) -> None:
        self.__gc_step__()
        self._tasks[stream] = self.loop.create_task(self._handle(stream, headers, release_stream))

    async def _handle(
        self, stream: Any, headers: list[tuple[str, str]], release_stream: Callable[[], Any]
    ) -> None:
        headers_map = dict(headers)
        path = headers_map.get(":path")
        method = self.mapping.get(path) if path in self._fast_methods else None
        request = deadline = None
        if method is not None and self._size_limit is not None and _plain_headers(headers_map, self.codec):
            try:
                # (grpclib's parse walks every header; most calls carry no grpc-timeout at all)
                deadline = Deadline.from_headers(headers) if "grpc-timeout" in headers_map else None
            except ValueError:  # grpclib answers it (UNKNOWN, "Invalid grpc-timeout header")
                pass
            else:
                request = _buffered_request(stream, method, self._size_limit.max_receive_message_size)
        if request is None:
            await request_handler(self.mapping, stream, headers, self.codec, self.status_details_codec,
                                  self.dispatch, release_stream)
            return
        if self._stats is not None:
            self._stats.num_fast_path_calls += 1
        try:
            await self._serve(stream, headers, headers_map, method, request, deadline)
        except ProtocolError:
            log.exception("Application error")
        except Exception:
            log.exception("Server error")
        finally:
            release_stream()

    async def _serve(self, stream: Any, headers: list[tuple[str, str]], headers_map: dict[str, str],
                     method: Any, body: bytes, deadline: Deadline | None) -> None:
        # NOTE: as grpclib's request_handler, for a call whose request is `body`.
        async with Stream(
            stream, headers_map[":path"], method.cardinality, method.request_type, method.reply_type,
            codec=self.codec, status_details_codec=self.status_details_codec, dispatch=self.dispatch,
            deadline=deadline, user_agent=headers_map.get("user-agent"),
        ) as call:
            wrapper: Wrapper
            deadline_wrapper: contextlib.AbstractContextManager[Any]
            if deadline is None:
                wrapper = stream.wrapper = Wrapper()
                deadline_wrapper = contextlib.nullcontext()
            else:
                wrapper = stream.wrapper = DeadlineWrapper()
                deadline_wrapper = wrapper.start(deadline)
            try:
                with deadline_wrapper, wrapper:
                    call.metadata = metadata = decode_metadata(headers)
                    method_func = method.func
                    for wrapper_listener in self._wrappers:  # as grpclib's RecvRequest dispatch, in order
                        method_func = wrapper_listener.wrap_method(
                            method_func, method_name=call._method_name, metadata=metadata, peer=call.peer
                        )
                    call.recv_message = _Once(call, body)  # type: ignore[method-assign]
                    await method_func(call)
            except GRPCError:
                raise
            except TimeoutError:
                if wrapper.cancel_failed:
                    log.exception("Failed to handle cancellation")
                    raise GRPCError(Status.DEADLINE_EXCEEDED) from None
                if wrapper.cancelled:
                    log.info("Deadline exceeded")
                    raise GRPCError(Status.DEADLINE_EXCEEDED) from None
                log.exception("Timeout occurred")
                raise
            except StreamTerminatedError as err:
                if wrapper.cancel_failed:
                    log.exception("Failed to handle cancellation")
                else:
                    log.info("Request was cancelled: %s", err)
                raise
            except Exception:
                log.exception("Application error")
                raise


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
    if not buffer._eof or buffer._acked:
        return None
    items = buffer._unacked._queue  # (data, data_size, ack_size); the end marker (b"", 0, 0) last
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
    queue, ack = buffer._unacked, buffer._ack_callback
    while not queue.empty():
        ack_size = queue.get_nowait()[2]
        if ack_size:
            ack(ack_size)  # as grpclib's Buffer.read acknowledges what it reads
    return data[MESSAGE_PREFIX.size:]
