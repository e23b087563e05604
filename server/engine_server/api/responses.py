"""Engine dataclasses -> protobuf response messages (the other half of `convert.py`).

Hot path: messages are built in place (`completions.add(...)`, `token_ids.extend(list)`), no intermediate
objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_proto.engine.v1 import generate_pb2, info_pb2

from engine_server.frontend.types import FinishReason, TokenLogprob

if TYPE_CHECKING:
    from engine_server.frontend.outputs import CompletionChunk, GenerateOutput
    from engine_server.frontend.types import EngineStats, ModelInfo

_FINISH = {
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT,
    FinishReason.DEAD_END: generate_pb2.FINISH_REASON_CONSTRAINT_DEAD_END,
}


def add_logprobs(repeated: Any, logprobs: Iterable[TokenLogprob | None]) -> None:
    """Append TokenLogprob messages; `None` entries (the first prompt token has none) are left out."""
    for lp in logprobs:
        if lp is None:
            continue
        item = repeated.add(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank)
        for token_id, logprob in lp.top:
            item.top.add(token_id=token_id, logprob=logprob)


def _set_finish(completion: generate_pb2.CompletionChunk, reason: FinishReason | None,
                stop_reason: str | int | None) -> None:
    if reason is None:
        return
    completion.finish_reason = _FINISH.get(reason, generate_pb2.FINISH_REASON_UNSPECIFIED)
    if reason is FinishReason.STOP:
        if isinstance(stop_reason, str):
            completion.stop_string = stop_reason
        elif stop_reason is not None:
            completion.stop_token_id = stop_reason


def _add_chunk(response: generate_pb2.GenerateResponse, chunk: CompletionChunk) -> None:
    completion = response.completions.add(index=chunk.index, text=chunk.text)
    completion.token_ids.extend(chunk.token_ids)
    if chunk.logprobs:
        add_logprobs(completion.logprobs, chunk.logprobs)
    _set_finish(completion, chunk.finish_reason, chunk.stop_reason)


def streaming_response(
    output: GenerateOutput, num_completion_tokens: list[int]
) -> generate_pb2.GenerateResponse:
    """One message per engine output; `num_completion_tokens[index]` is updated and summed into the usage."""
    response = generate_pb2.GenerateResponse(request_id=output.request_id)
    for chunk in output.chunks:
        _add_chunk(response, chunk)
        num_completion_tokens[chunk.index] = chunk.num_completion_tokens
    if output.prompt_logprobs:
        add_logprobs(response.prompt_logprobs, output.prompt_logprobs)
    if output.finished:
        response.usage.prompt_tokens = output.num_prompt_tokens
        response.usage.completion_tokens = sum(num_completion_tokens)
        response.usage.cached_prompt_tokens = output.num_cached_prompt_tokens
    return response


class PlainResponses:
    """One request's commonest streamed message, serialized by reusing one message.

    NOTE: "plain" is new tokens (and their text) of completion 0 and nothing else: no finish, logprobs, usage
    or other completions. Most messages of a stream are plain; refilling one upb message whose request_id is
    set once serializes ~2x faster than building a new message each time (1.8 -> 0.9 us here).
    """

    __slots__ = ("_completion", "_message", "_request_id")

    def __init__(self, request_id: str) -> None:
        # NOTE: the message is built at the first plain message: a short request may have none (~3 us saved)
        self._request_id = request_id
        self._message: generate_pb2.GenerateResponse | None = None
        self._completion: generate_pb2.CompletionChunk | None = None

    def serialize(self, output: GenerateOutput, num_completion_tokens: list[int]) -> bytes | None:
        """`streaming_response(output, num_completion_tokens)`'s bytes (and count update) for a plain output;
        None (nothing updated) for any other."""
        chunks = output.chunks
        if len(chunks) != 1 or output.finished or output.prompt_logprobs:
            return None
        chunk = chunks[0]
        if chunk.index or chunk.logprobs or chunk.finish_reason is not None:
            return None
        num_completion_tokens[0] = chunk.num_completion_tokens
        return self.serialize_plain(chunk.token_ids, chunk.text)

    def serialize_plain(self, token_ids: list[int], text: str) -> bytes:
        """The message of plain news of completion 0 (no finish or logprobs: outputs.PlainSink's)."""
        message, completion = self._message, self._completion
        if message is None or completion is None:
            message = self._message = generate_pb2.GenerateResponse(request_id=self._request_id)
            completion = self._completion = message.completions.add()
        completion.token_ids[:] = token_ids  # (one slice assignment: ~0.2 us less than del + extend)
        completion.text = text
        payload: bytes = message.SerializeToString()
        return payload


@dataclass(slots=True)
class _Completion:
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_tokens: int = 0


class Collector:
    """Gathers a non-streaming request's outputs into the one message the contract asks for."""

    __slots__ = ("_completions", "_last", "_prompt_logprobs")

    def __init__(self, n: int) -> None:
        self._completions = [_Completion() for _ in range(n)]
        self._prompt_logprobs: list[TokenLogprob | None] | None = None
        self._last: GenerateOutput | None = None

    def add(self, output: GenerateOutput) -> None:
        for chunk in output.chunks:
            completion = self._completions[chunk.index]
            completion.token_ids.extend(chunk.token_ids)
            if chunk.text:
                completion.texts.append(chunk.text)
            if chunk.logprobs:
                completion.logprobs.extend(chunk.logprobs)
            if chunk.finish_reason is not None:
                completion.finish_reason = chunk.finish_reason
                completion.stop_reason = chunk.stop_reason
            completion.num_tokens = chunk.num_completion_tokens
        if output.prompt_logprobs:
            self._prompt_logprobs = output.prompt_logprobs
        self._last = output

    def response(self, request_id: str) -> generate_pb2.GenerateResponse:
        response = generate_pb2.GenerateResponse(request_id=request_id)
        for index, completion in enumerate(self._completions):
            item = response.completions.add(index=index, text="".join(completion.texts))
            item.token_ids.extend(completion.token_ids)
            if completion.logprobs:
                add_logprobs(item.logprobs, completion.logprobs)
            _set_finish(item, completion.finish_reason, completion.stop_reason)
        if self._prompt_logprobs:
            add_logprobs(response.prompt_logprobs, self._prompt_logprobs)
        last = self._last
        if last is not None:
            response.usage.prompt_tokens = last.num_prompt_tokens
            response.usage.cached_prompt_tokens = last.num_cached_prompt_tokens
        response.usage.completion_tokens = sum(c.num_tokens for c in self._completions)
        return response


def model_info_response(
    info: ModelInfo, *, served_model_name: str, has_chat_template: bool
) -> info_pb2.GetModelInfoResponse:
    is_embed = info.task == "embed"
    response = info_pb2.GetModelInfoResponse(
        served_model_name=served_model_name,
        model_path=info.model_path,
        architecture=info.architecture,
        task=info_pb2.MODEL_TASK_EMBED if is_embed else info_pb2.MODEL_TASK_GENERATE,
        max_context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        dtype=info.dtype,
        embedding_dimension=(info.embedding_dim or 0) if is_embed else 0,
        num_parameters=info.num_parameters,
        has_chat_template=has_chat_template,
        device=info.device,
    )
    special = response.special_tokens
    if info.bos_token_id is not None:
        special.bos_token_id = info.bos_token_id
    special.eos_token_ids.extend(info.eos_token_ids)
    if info.pad_token_id is not None:
        special.pad_token_id = info.pad_token_id
    return response


def fill_load(load: info_pb2.Load, stats: EngineStats | None) -> None:
    if stats is None:  # still starting: no engine yet
        return
    load.num_running_requests = stats.num_running
    load.num_waiting_requests = stats.num_waiting
    load.kv_cache_usage = stats.kv_cache_usage
    load.num_free_kv_blocks = stats.num_free_blocks
    load.num_total_kv_blocks = stats.num_total_blocks
    load.num_running_completions = stats.num_running_completions
