"""Per-request frontend state: turns engine deltas into text (detokenizer + stop strings) and coalesces
everything ready into one pending output, so a slow consumer wakes once per step, not once per token.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from engine_server.engine.types import CompletionDelta, FinishReason, TokenLogprob
from engine_server.frontend.detokenizer import DetokenizerFactory
from engine_server.frontend.outputs import (
    CompletionChunk,
    GenerateOutput,
    GenerateRequest,
    OutputSink,
    PlainSink,
)
from engine_server.frontend.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)


class _Completion:
    __slots__ = ("detokenizer", "is_finished", "matcher", "num_tokens")

    def __init__(
        self, request: GenerateRequest, detokenizers: DetokenizerFactory, context: list[int] | None
    ) -> None:
        self.detokenizer = (
            detokenizers.new(context, skip_special_tokens=request.skip_special_tokens)
            if context is not None
            else None
        )
        self.matcher = (
            StopStringMatcher(request.stop, include_in_output=request.include_stop_str_in_output)
            if request.stop
            else None
        )
        self.num_tokens = 0
        self.is_finished = False


class RequestState:
    """Everything the frontend tracks for one in-flight request."""

    __slots__ = (
        "_completions",
        "_error_text",
        "_pending",
        "_plain_ids",
        "_plain_text",
        "_prompt_logprobs",
        "_request",
        "abort_sent",
        "declined",
        "error",
        "has_news",
        "has_output",
        "num_cached_prompt_tokens",
        "num_engine_unfinished",
        "num_prompt_tokens",
        "num_unfinished",
        "on_ready",
        "plain_sink",
        "request_id",
        "sink",
        "waiter",
    )

    def __init__(self, request: GenerateRequest, detokenizers: DetokenizerFactory) -> None:
        self.request_id = request.request_id
        self._request = request
        n = request.params.n
        # The prompt's last ids that every completion's text is decoded after (None: no text is needed).
        context = (
            detokenizers.prompt_context(
                request.prompt_token_ids, skip_special_tokens=request.skip_special_tokens)
            if request.detokenize or request.stop
            else None
        )
        self._completions = [_Completion(request, detokenizers, context) for _ in range(n)]
        self._pending: dict[int, CompletionChunk] = {}
        # Plain news (new tokens and text of completion 0, nothing else pending) gathers here, not in a
        # CompletionChunk: most news is plain and goes to the plain sink as it is (outputs.PlainSink).
        # Whatever else arrives, and `take`, make it a pending chunk first (`_pending_plain`): order holds.
        self._plain_ids: list[int] | None = None  # None: no plain news (then `_plain_text` is "")
        self._plain_text = ""
        self.has_news = False  # pending output for the consumer (or the sinks); set here only
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached_prompt_tokens = 0
        self._prompt_logprobs: list[TokenLogprob | None] | None = None
        self.num_unfinished = n  # as the consumer sees it
        self.num_engine_unfinished = n  # as the engine core sees it: the record lives until this is 0
        self.has_output = False  # the engine produced something: the request is running, not waiting
        self.waiter: asyncio.Future[None] | None = None  # set while the consumer waits for news
        # called (once) instead of waking a consumer that is not waiting (RequestStream.set_ready_callback)
        self.on_ready: Callable[[], None] | None = None
        self.sink: OutputSink | None = None  # offered each output before the consumer is woken
        self.plain_sink: PlainSink | None = None  # offered plain news first (outputs.PlainSink); needs `sink`
        self.declined: deque[GenerateOutput] = deque()  # what the sink declined: the consumer yields it
        self.error: BaseException | None = None  # raised to the consumer after pending output
        self._error_text: str | None = None
        self.abort_sent = False  # the engine was told to abort it; its final deltas are still to come

    # --- producer side (the engine's output task) ---------------------------------------------------

    def add_tokens(self, token_ids: list[int]) -> bool:
        """New tokens of completion 0 and nothing else (StepOutput's columns); as `process`."""
        self.has_output = True
        completion = self._completions[0]
        if completion.is_finished or not token_ids:
            return False
        if completion.matcher is not None:  # stop strings: token by token
            return self._apply(0, completion, token_ids, None, None, None)
        # NOTE: without stop strings there is a detokenizer exactly when text was asked for.
        detokenizer = completion.detokenizer
        text = detokenizer.add_many(token_ids) if detokenizer is not None else ""
        completion.num_tokens += len(token_ids)
        if self._pending:  # other news waits: merge with it, in order
            self._add_chunk(0, token_ids, text, None, None, None)
            return False
        self.has_news = True
        plain_ids = self._plain_ids
        if plain_ids is None:
            self._plain_ids = token_ids  # (the list is ours: it came off the core's pipe)
            self._plain_text = text
        else:
            plain_ids.extend(token_ids)
            self._plain_text += text
        return False

    def process(self, delta: CompletionDelta) -> bool:
        """Apply one engine delta. Call `wake()` once after the whole step has been processed.

        Returns True when it ended the completion here (a stop string) while the engine still runs it.
        """
        self.has_output = True
        finish = delta.finish_reason
        if finish is not None:
            self.num_engine_unfinished -= 1
        if delta.index == 0 and delta.num_prompt_tokens:
            self.num_prompt_tokens = delta.num_prompt_tokens
            self.num_cached_prompt_tokens = delta.num_cached_prompt_tokens
            if delta.prompt_logprobs is not None:
                self._prompt_logprobs = delta.prompt_logprobs
                self.has_news = True
        completion = self._completions[delta.index]
        if completion.is_finished:
            return False  # finished here first (a stop string, or an abort); the engine is catching up
        if finish is FinishReason.ERROR:
            self._error_text = delta.error or "the engine failed this request"
        return self._apply(delta.index, completion, delta.new_token_ids, delta.logprobs, finish,
                           delta.stop_token_id)

    def _apply(
        self,
        index: int,
        completion: _Completion,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        finish: FinishReason | None,
        stop_token_id: int | None,
    ) -> bool:
        engine_finish = finish
        stop_reason: str | int | None = None
        text = ""
        detokenizer = completion.detokenizer
        if detokenizer is not None:
            matcher = completion.matcher
            if matcher is None:
                text = detokenizer.add_many(token_ids) if token_ids else ""
                if finish is not None:
                    text += detokenizer.finish()
            else:
                # Token by token, so a stop string cuts the ids right after the token that completed it.
                matched: str | None = None
                for position, token_id in enumerate(token_ids):
                    piece, matched = matcher.feed(detokenizer.add(token_id))
                    text += piece
                    if matched is not None:
                        token_ids = token_ids[:position + 1]
                        if logprobs is not None:
                            logprobs = logprobs[:position + 1]
                        break
                if matched is None and finish is not None:
                    piece, matched = matcher.feed(detokenizer.finish())
                    text += piece if matched is not None else piece + matcher.flush()
                if matched is not None:
                    finish, stop_reason = FinishReason.STOP, matched
            if not self._request.detokenize:
                text = ""
        if finish is not None and stop_reason is None:
            stop_reason = stop_token_id
        completion.num_tokens += len(token_ids)
        if not token_ids and not text and finish is None:
            return False
        self._add_chunk(index, token_ids, text, logprobs, finish, stop_reason)
        if finish is None:
            return False
        completion.is_finished = True
        self.num_unfinished -= 1
        return engine_finish is None

    def _add_chunk(
        self,
        index: int,
        token_ids: list[int],
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish: FinishReason | None,
        stop_reason: str | int | None,
    ) -> None:
        if self._plain_ids is not None:
            self._pending_plain()
        self.has_news = True
        num_tokens = self._completions[index].num_tokens
        chunk = self._pending.get(index)
        if chunk is None:
            self._pending[index] = CompletionChunk(
                index, token_ids, text, logprobs, finish, stop_reason, num_tokens
            )
            return
        chunk.token_ids.extend(token_ids)
        chunk.text += text
        if logprobs is not None:
            if chunk.logprobs is None:
                chunk.logprobs = list(logprobs)
            else:
                chunk.logprobs.extend(logprobs)
        chunk.finish_reason = finish
        chunk.stop_reason = stop_reason
        chunk.num_completion_tokens = num_tokens

    def _pending_plain(self) -> None:
        """The plain news, as the pending chunk of completion 0 (nothing else is pending while it gathers)."""
        token_ids, text = self._plain_ids, self._plain_text
        assert token_ids is not None
        assert not self._pending
        self._plain_ids, self._plain_text = None, ""
        self._pending[0] = CompletionChunk(
            0, token_ids, text, None, None, None, self._completions[0].num_tokens
        )

    def finish_locally(self, reason: FinishReason, *, notify: bool) -> None:
        """End every unfinished completion now (abort, shutdown); `notify` queues a final chunk for each."""
        for index, completion in enumerate(self._completions):
            if completion.is_finished:
                continue
            completion.is_finished = True
            if notify:
                self._add_chunk(index, [], "", None, reason, None)
        self.num_unfinished = 0
        self.wake()

    def fail(self, error: BaseException) -> None:
        """The request cannot continue (core died, or the core rejected it): the consumer gets `error`."""
        self.num_engine_unfinished = 0
        if self.num_unfinished == 0:
            return  # already ended here (abort, stop string): the consumer has its final output
        for completion in self._completions:
            completion.is_finished = True
        self.num_unfinished = 0
        self.error = error
        self.wake()

    def wake(self) -> None:
        sink = self.sink
        if sink is not None and self.has_news and self.error is None and not self.declined:
            plain_sink = self.plain_sink
            if plain_sink is not None and self._offer_plain(plain_sink):
                return  # delivered; the request goes on: the consumer has nothing to do
            output = self.take()
            try:
                delivered = sink(output) if self.sink is not None else False  # (None: plain_sink failed)
            except Exception:  # NOTE: a failing sink must not reach the engine's output task
                self._drop_sinks()
                delivered = False
            if not delivered:
                self.declined.append(output)
            elif not output.finished:
                return  # delivered: the consumer has nothing to do
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)
            return
        on_ready = self.on_ready
        if on_ready is not None:
            self.on_ready = None
            try:
                on_ready()
            except Exception:  # NOTE: as a failing sink: must not reach the engine's output task
                logger.exception("ready callback of request %s failed", self.request_id)

    def _offer_plain(self, plain_sink: PlainSink) -> bool:
        """The news to `plain_sink` if it is plain (outputs.PlainSink); True: it was delivered."""
        if self._prompt_logprobs is not None or self.num_unfinished == 0:
            return False
        token_ids = self._plain_ids
        pending = self._pending
        if token_ids is not None:  # (then nothing is pending)
            text, num_tokens = self._plain_text, self._completions[0].num_tokens
        else:  # a pending chunk can be plain news too (e.g. a request's first tokens, which come as a delta)
            chunk = pending.get(0)
            if chunk is None or len(pending) != 1 or chunk.finish_reason is not None or chunk.logprobs:
                return False
            token_ids, text, num_tokens = chunk.token_ids, chunk.text, chunk.num_completion_tokens
        try:
            delivered = plain_sink(token_ids, text, num_tokens)
        except Exception:  # NOTE: as a failing sink: logged, and the consumer takes over
            self._drop_sinks()
            return False
        if delivered:
            self._plain_ids, self._plain_text = None, ""
            pending.clear()
            self.has_news = False
        return delivered

    def _drop_sinks(self) -> None:
        logger.exception("output sink of request %s failed; falling back to its consumer", self.request_id)
        self.sink = self.plain_sink = None

    # --- consumer side ------------------------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        return self.num_unfinished == 0

    def take(self) -> GenerateOutput:
        if self._plain_ids is not None:
            self._pending_plain()
        pending = self._pending
        chunks = list(pending.values())
        if len(chunks) > 1:
            chunks.sort(key=_chunk_index)
        pending.clear()
        self.has_news = False
        prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        return GenerateOutput(
            self.request_id, chunks, self.num_prompt_tokens, self.num_cached_prompt_tokens,
            prompt_logprobs, self.num_unfinished == 0, self._error_text,
        )


def _chunk_index(chunk: CompletionChunk) -> int:
    return chunk.index
