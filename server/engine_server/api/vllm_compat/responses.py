"""Engine outputs -> vllm.grpc.engine.GenerateResponse messages, following the gateway's streaming contract.

stream=true: every generated token goes out in a `chunk` (token ids are deltas, `completion_tokens` the
delta's length: smg accumulates the chunks and drops tokens that arrive only in a `complete`); when a
completion finishes, a `complete` with its finish reason follows. stream=false: one `complete` per
completion once all n are done, carrying all its tokens. This is vLLM's own servicer's wire behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from engine_server.frontend.outputs import CompletionChunk, GenerateOutput
from engine_server.frontend.types import FinishReason, TokenLogprob

# vLLM's finish_reason strings. NOTE: smg matches exactly "stop", "length", "abort" and "error" (and turns a
# "stop" with parsed tool calls into OpenAI's "tool_calls"); a constraint's dead end (no next token allowed:
# the output is a valid but incomplete prefix of its language) has no vLLM name of its own, and "stop" is
# what an OpenAI client handles: the completion ended where the constraint let it, not at max_tokens.
FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
    FinishReason.DEAD_END: "stop",
}


class EngineRequestFailed(RuntimeError):
    """The engine failed while running the request (a FinishReason.ERROR completion)."""


def _top_logprobs(top: Sequence[tuple[int, float]]) -> Any:
    return pb.TopLogProbs(token_ids=[token_id for token_id, _ in top], values=[value for _, value in top])


def output_logprobs(logprobs: Sequence[TokenLogprob], num_top: int) -> Any:
    message = pb.OutputLogProbs()
    for entry in logprobs:
        message.token_ids.append(entry.token_id)
        message.token_logprobs.append(entry.logprob)
        if num_top > 0:
            message.top_logprobs.append(_top_logprobs(entry.top[:num_top]))
    return message


def input_logprobs(
    prompt_token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], num_top: int
) -> Any:
    message = pb.InputLogProbs()
    for token_id, entry in zip(prompt_token_ids, logprobs, strict=False):
        message.token_ids.append(token_id)
        value = pb.InputTokenLogProb()
        if entry is not None:  # NOTE: the first prompt token has none; `value` stays unset
            value.value = entry.logprob
        message.token_logprobs.append(value)
        if num_top > 0:
            message.top_logprobs.append(_top_logprobs(entry.top[:num_top] if entry is not None else ()))
    return message


class _Completion:
    __slots__ = ("finish_reason", "logprobs", "stop_reason", "token_ids")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None


class ResponseBuilder:
    """Turns one request's GenerateOutputs into the messages to send, in order."""

    def __init__(
        self,
        *,
        stream: bool,
        prompt_token_ids: Sequence[int],
        num_logprobs: int | None,
        num_prompt_logprobs: int | None,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self._stream = stream
        self._prompt_token_ids = prompt_token_ids
        self._num_logprobs = num_logprobs
        self._num_prompt_logprobs = num_prompt_logprobs
        self._stop_token_ids = frozenset(stop_token_ids)
        self._completions: dict[int, _Completion] = {}
        self._input_logprobs: Any = None
        self._has_sent_input_logprobs = False
        self._num_cached_tokens = 0

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated so far, all completions together."""
        return sum(len(completion.token_ids) for completion in self._completions.values())

    def on_output(self, output: GenerateOutput) -> list[Any]:
        """The messages this output produces. Raises EngineRequestFailed for an engine failure."""
        if output.error is not None:
            raise EngineRequestFailed(output.error)
        self._num_cached_tokens = max(self._num_cached_tokens, output.num_cached_prompt_tokens)
        if output.prompt_logprobs is not None and self._num_prompt_logprobs is not None:
            self._input_logprobs = input_logprobs(
                self._prompt_token_ids, output.prompt_logprobs, self._num_prompt_logprobs
            )
        messages: list[Any] = []
        for chunk in output.chunks:
            if chunk.finish_reason is FinishReason.ERROR:
                raise EngineRequestFailed(f"completion {chunk.index} failed in the engine")
            completion = self._completions.setdefault(chunk.index, _Completion())
            completion.token_ids.extend(chunk.token_ids)
            if chunk.logprobs:
                completion.logprobs.extend(chunk.logprobs)
            if chunk.finish_reason is not None:
                completion.finish_reason = chunk.finish_reason
                completion.stop_reason = chunk.stop_reason
            if self._stream:
                messages.extend(self._stream_messages(chunk, completion))
        if not self._stream and output.finished:
            messages.extend(self._complete(index, c) for index, c in sorted(self._completions.items()))
        return messages

    def _stream_messages(self, chunk: CompletionChunk, completion: _Completion) -> list[Any]:
        messages = []
        pending_input_logprobs = self._input_logprobs is not None and not self._has_sent_input_logprobs
        if chunk.token_ids or pending_input_logprobs:
            message = pb.GenerateStreamChunk(
                token_ids=chunk.token_ids,
                prompt_tokens=len(self._prompt_token_ids),
                completion_tokens=len(chunk.token_ids),
                cached_tokens=self._num_cached_tokens,
                index=chunk.index,
            )
            if chunk.logprobs and self._num_logprobs is not None:
                message.output_logprobs.CopyFrom(output_logprobs(chunk.logprobs, self._num_logprobs))
            if pending_input_logprobs:
                message.input_logprobs.CopyFrom(self._input_logprobs)
                self._has_sent_input_logprobs = True
            messages.append(pb.GenerateResponse(chunk=message))
        if chunk.finish_reason is not None:
            messages.append(self._complete(chunk.index, completion))
        return messages

    def _complete(self, index: int, completion: _Completion) -> Any:
        reason = completion.finish_reason or FinishReason.ABORT
        message = pb.GenerateComplete(
            output_ids=completion.token_ids,
            finish_reason=FINISH_REASONS[reason],
            prompt_tokens=len(self._prompt_token_ids),
            completion_tokens=len(completion.token_ids),
            cached_tokens=self._num_cached_tokens,
            index=index,
        )
        if completion.logprobs and self._num_logprobs is not None:
            message.output_logprobs.CopyFrom(output_logprobs(completion.logprobs, self._num_logprobs))
        if self._input_logprobs is not None:
            message.input_logprobs.CopyFrom(self._input_logprobs)
        stop_reason = completion.stop_reason
        if isinstance(stop_reason, str):
            message.matched_stop_str = stop_reason
        elif isinstance(stop_reason, int) and stop_reason in self._stop_token_ids:
            # NOTE: like vLLM, EOS is not a "matched stop"; only the request's own stop_token_ids are.
            message.matched_token_id = stop_reason
        return pb.GenerateResponse(complete=message)
