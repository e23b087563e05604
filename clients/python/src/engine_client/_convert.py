"""upb ``_pb2`` responses -> the small typed result objects of :mod:`engine_client.types`."""

from __future__ import annotations

from collections.abc import Iterable

from engine_proto.engine.v1 import embed_pb2, generate_pb2, info_pb2, tokenize_pb2

from .adapters import adapter_info
from .types import (
    Completion,
    Embedding,
    EmbedResult,
    EngineState,
    FinishReason,
    GenerateChunk,
    GenerateResult,
    Load,
    ModelInfo,
    ModelTask,
    ServerInfo,
    ServerLimits,
    TokenizeResult,
    TokenLogprob,
    TopLogprob,
    Usage,
)

# NOTE: index = the proto enum number; numbers past the end (a newer server) and negative ones (enums are
# open: any int32 parses) map to UNKNOWN/UNSPECIFIED.
_FINISH = (None, FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT,
           FinishReason.CONSTRAINT_DEAD_END)
_STATES = (EngineState.UNSPECIFIED, EngineState.STARTING, EngineState.SERVING, EngineState.DRAINING,
           EngineState.FAILED)
_TASKS = (ModelTask.UNSPECIFIED, ModelTask.GENERATE, ModelTask.EMBED)


def finish_reason(value: int) -> FinishReason | None:
    return _FINISH[value] if 0 <= value < len(_FINISH) else FinishReason.UNKNOWN


def engine_state(value: int) -> EngineState:
    return _STATES[value] if 0 <= value < len(_STATES) else EngineState.UNSPECIFIED


def logprobs(items: Iterable[generate_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(lp.token_id, lp.logprob, lp.rank,
                     tuple(TopLogprob(t.token_id, t.logprob) for t in lp.top))
        for lp in items
    )


def usage(msg: generate_pb2.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_prompt_tokens)


def chunks(resp: generate_pb2.GenerateResponse) -> list[GenerateChunk]:
    """One GenerateChunk per CompletionChunk; usage goes on the last, prompt logprobs on the first."""
    request_id = resp.request_id
    final_usage = usage(resp.usage) if resp.HasField("usage") else None
    prompt_lps = logprobs(resp.prompt_logprobs) if resp.prompt_logprobs else None
    completions = resp.completions
    count = len(completions)
    if count == 0:
        if final_usage is None and prompt_lps is None:
            return []
        # A message with only usage / prompt logprobs still reaches the caller, as an empty chunk of index 0.
        return [GenerateChunk(request_id, 0, (), "", None, None, None, final_usage, prompt_lps)]
    out = []
    for i, c in enumerate(completions):
        which = c.WhichOneof("matched_stop")
        stop: str | int | None = None
        if which == "stop_string":
            stop = c.stop_string
        elif which == "stop_token_id":
            stop = c.stop_token_id
        reason = c.finish_reason
        out.append(GenerateChunk(
            request_id,
            c.index,
            tuple(c.token_ids),
            c.text,
            logprobs(c.logprobs) if c.logprobs else None,
            finish_reason(reason) if reason else None,
            stop,
            final_usage if i == count - 1 else None,
            prompt_lps if i == 0 else None,
        ))
    return out


class ResultCollector:
    """Accumulates streamed chunks into a :class:`GenerateResult` (what ``complete`` returns)."""

    __slots__ = ("_logprobs", "_reasons", "_stops", "_texts", "_token_ids", "prompt_logprobs", "request_id",
                 "usage")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.usage: Usage | None = None
        self.prompt_logprobs: tuple[TokenLogprob, ...] | None = None
        self._texts: dict[int, list[str]] = {}
        self._token_ids: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self._reasons: dict[int, FinishReason | None] = {}
        self._stops: dict[int, str | int | None] = {}

    def add(self, chunk: GenerateChunk) -> None:
        i = chunk.index
        self.request_id = chunk.request_id or self.request_id
        self._texts.setdefault(i, []).append(chunk.text)
        self._token_ids.setdefault(i, []).extend(chunk.token_ids)
        self._reasons.setdefault(i, None)
        if chunk.logprobs is not None:
            self._logprobs.setdefault(i, []).extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self._reasons[i] = chunk.finish_reason
            self._stops[i] = chunk.stop
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs

    def result(self) -> GenerateResult:
        completions = tuple(
            Completion(
                index=i,
                text="".join(self._texts[i]),
                token_ids=tuple(self._token_ids[i]),
                finish_reason=self._reasons[i],
                stop=self._stops.get(i),
                logprobs=tuple(self._logprobs[i]) if i in self._logprobs else None,
            )
            for i in sorted(self._texts)
        )
        return GenerateResult(self.request_id, completions, self.usage, self.prompt_logprobs)


def embed_result(resp: embed_pb2.EmbedResponse) -> EmbedResult:
    return EmbedResult(
        tuple(Embedding(tuple(e.values), e.num_tokens) for e in resp.embeddings),
        usage(resp.usage) if resp.HasField("usage") else None,
    )


def tokenize_result(resp: tokenize_pb2.TokenizeResponse) -> TokenizeResult:
    offsets = tuple((o.start, o.end) for o in resp.offsets) if resp.offsets else None
    return TokenizeResult(tuple(resp.token_ids), offsets)


def model_info(resp: info_pb2.GetModelInfoResponse) -> ModelInfo:
    sp = resp.special_tokens
    return ModelInfo(
        served_model_name=resp.served_model_name,
        model_path=resp.model_path,
        architecture=resp.architecture,
        task=_TASKS[resp.task] if 0 <= resp.task < len(_TASKS) else ModelTask.UNSPECIFIED,
        max_context_length=resp.max_context_length,
        vocab_size=resp.vocab_size,
        bos_token_id=sp.bos_token_id if sp.HasField("bos_token_id") else None,
        eos_token_ids=tuple(sp.eos_token_ids),
        pad_token_id=sp.pad_token_id if sp.HasField("pad_token_id") else None,
        dtype=resp.dtype,
        embedding_dimension=resp.embedding_dimension,
        num_parameters=resp.num_parameters,
        has_chat_template=resp.has_chat_template,
        device=resp.device,
        adapters=tuple(adapter_info(x) for x in resp.adapters),
    )


def load(msg: info_pb2.Load, state: int) -> Load:
    return Load(
        state=engine_state(state),
        num_running_requests=msg.num_running_requests,
        num_waiting_requests=msg.num_waiting_requests,
        kv_cache_usage=msg.kv_cache_usage,
        num_free_kv_blocks=msg.num_free_kv_blocks,
        num_total_kv_blocks=msg.num_total_kv_blocks,
        num_running_completions=msg.num_running_completions,
    )


def server_info(resp: info_pb2.GetServerInfoResponse) -> ServerInfo:
    lim = resp.limits
    return ServerInfo(
        server_version=resp.server_version,
        api_version=resp.api_version,
        uptime_seconds=resp.uptime_seconds,
        state=engine_state(resp.state),
        load=load(resp.load, resp.state),
        limits=ServerLimits(
            max_model_len=lim.max_model_len,
            max_num_seqs=lim.max_num_seqs,
            max_waiting_requests=lim.max_waiting_requests,
            max_concurrent_streams=lim.max_concurrent_streams,
            max_receive_message_bytes=lim.max_receive_message_bytes,
            kv_block_size=lim.kv_block_size,
            max_num_batched_tokens=lim.max_num_batched_tokens,
            max_adapters=lim.max_adapters,
            max_lora_rank=lim.max_lora_rank,
        ),
        adapters=tuple(resp.adapters),
    )
