"""Plain Python arguments -> upb ``_pb2`` request messages (the hot path: no per-field Python objects)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

from engine_proto.engine.v1 import embed_pb2, generate_pb2, tokenize_pb2

from .params import GenerateParams, merge_params

ChatMessage = Mapping[str, str]


def _fill_chat(chat: generate_pb2.ChatMessages, messages: Sequence[ChatMessage],
               add_generation_prompt: bool | None) -> None:
    if not messages:
        raise ValueError("messages must hold at least one message")
    for message in messages:
        try:
            chat.messages.add(role=message["role"], content=message.get("content", ""))
        except KeyError:
            raise ValueError("every message needs a 'role'") from None
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt


def _one_input(prompt: object, token_ids: object, messages: object) -> None:
    given = sum(x is not None for x in (prompt, token_ids, messages))
    if given != 1:
        raise ValueError("pass exactly one of prompt (text), token_ids or messages")


def build_generate_request(
    prompt: str | None,
    *,
    token_ids: Sequence[int] | None,
    messages: Sequence[ChatMessage] | None,
    request_id: str,
    stream: bool,
    params: GenerateParams,
) -> generate_pb2.GenerateRequest:
    """Build a GenerateRequest; every knob left at None stays unset (the server's default)."""
    _one_input(prompt, token_ids, messages)
    req = generate_pb2.GenerateRequest(request_id=request_id, stream=stream)
    if token_ids is not None:
        if len(token_ids) == 0:
            raise ValueError("token_ids must not be empty")
        req.token_ids.ids.extend(token_ids)
    elif messages is not None:
        _fill_chat(req.chat, messages, params.add_generation_prompt)
    else:
        req.text = prompt  # type: ignore[assignment]  # _one_input guarantees a str here
    p = params
    if p.add_special_tokens is not None:
        req.add_special_tokens = p.add_special_tokens
    # NOTE: touch a sub-message only when one of its fields is set, so unset stays unset on the wire.
    if (p.temperature is not None or p.top_p is not None or p.top_k is not None or p.min_p is not None
            or p.repetition_penalty is not None or p.presence_penalty is not None
            or p.frequency_penalty is not None or p.seed is not None or p.logit_bias or p.n is not None):
        s = req.sampling
        if p.temperature is not None:
            s.temperature = p.temperature
        if p.top_p is not None:
            s.top_p = p.top_p
        if p.top_k is not None:
            s.top_k = p.top_k
        if p.min_p is not None:
            s.min_p = p.min_p
        if p.repetition_penalty is not None:
            s.repetition_penalty = p.repetition_penalty
        if p.presence_penalty is not None:
            s.presence_penalty = p.presence_penalty
        if p.frequency_penalty is not None:
            s.frequency_penalty = p.frequency_penalty
        if p.seed is not None:
            s.seed = p.seed
        if p.logit_bias:
            s.logit_bias.update(p.logit_bias)
        if p.n is not None:
            s.n = p.n
    if (p.max_tokens is not None or p.min_tokens or p.stop or p.stop_token_ids or p.ignore_eos
            or p.include_stop_string):
        st = req.stopping
        if p.max_tokens is not None:
            st.max_tokens = p.max_tokens
        st.min_tokens = p.min_tokens
        if p.stop:
            st.stop.extend(p.stop)
        if p.stop_token_ids:
            st.stop_token_ids.extend(p.stop_token_ids)
        st.ignore_eos = p.ignore_eos
        st.include_stop_string = p.include_stop_string
    if (p.logprobs is not None or p.prompt_logprobs is not None or p.return_text is not None
            or p.skip_special_tokens is not None):
        o = req.output
        if p.logprobs is not None:
            o.logprobs = p.logprobs
        if p.prompt_logprobs is not None:
            o.prompt_logprobs = p.prompt_logprobs
        if p.return_text is not None:
            o.return_text = p.return_text
        if p.skip_special_tokens is not None:
            o.skip_special_tokens = p.skip_special_tokens
    return req


def build_generate_call(
    prompt: str | None,
    *,
    token_ids: Sequence[int] | None,
    messages: Sequence[ChatMessage] | None,
    request_id: str | None,
    stream: bool,
    params: GenerateParams | None,
    options: Mapping[str, object],
) -> tuple[str, generate_pb2.GenerateRequest]:
    """The arguments of ``generate`` (both clients) -> (request id, request).

    ``request_id`` defaults to a fresh uuid4 hex; keyword ``options`` override ``params`` knob by knob.
    """
    rid = request_id if request_id is not None else uuid.uuid4().hex
    request = build_generate_request(prompt, token_ids=token_ids, messages=messages, request_id=rid,
                                     stream=stream, params=merge_params(params, options))
    return rid, request


EmbedInput = str | Sequence[int]


def build_embed_request(
    inputs: str | Sequence[EmbedInput], *, normalize: bool | None, add_special_tokens: bool | None
) -> embed_pb2.EmbedRequest:
    """One text, or a batch of texts and/or token id lists."""
    batch: Sequence[EmbedInput] = [inputs] if isinstance(inputs, str) else inputs
    if len(batch) == 0:
        raise ValueError("inputs must not be empty")
    req = embed_pb2.EmbedRequest()
    for item in batch:
        entry = req.inputs.add()
        if isinstance(item, str):
            entry.text = item
        else:
            entry.token_ids.ids.extend(item)
    if normalize is not None:
        req.normalize = normalize
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req


def build_tokenize_request(
    text: str | None,
    *,
    messages: Sequence[ChatMessage] | None,
    add_special_tokens: bool | None,
    add_generation_prompt: bool | None,
    return_offsets: bool,
) -> tokenize_pb2.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("pass exactly one of text or messages")
    req = tokenize_pb2.TokenizeRequest(return_offsets=return_offsets)
    if text is not None:
        req.text = text
    else:
        _fill_chat(req.chat, messages or (), add_generation_prompt)
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req


def build_detokenize_request(
    token_ids: Sequence[int], *, skip_special_tokens: bool | None
) -> tokenize_pb2.DetokenizeRequest:
    req = tokenize_pb2.DetokenizeRequest(token_ids=token_ids)
    if skip_special_tokens is not None:
        req.skip_special_tokens = skip_special_tokens
    return req


def build_abort_request(request_ids: str | Sequence[str]) -> generate_pb2.AbortRequest:
    ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
    return generate_pb2.AbortRequest(request_ids=ids)
