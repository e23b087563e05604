"""Plain Python arguments -> upb ``_pb2`` request messages (the hot path: no per-field Python objects)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from engine_proto.engine.v1 import embed_pb2, generate_pb2, tokenize_pb2
from google.protobuf.message import Message

from .params import GenerateParams, merge_params
from .structured import Choice, Grammar, JsonObject, JsonSchema, Regex, StructuredOutput

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


def _knobs(message: type[Message], names: tuple[str, ...]) -> tuple[tuple[str, bool], ...]:
    fields = message.DESCRIPTOR.fields_by_name
    return tuple((name, fields[name].has_presence) for name in names)


# The GenerateParams knobs each sub-message carries (named alike in the contract), with whether the field has
# presence (``optional``): a field without it (min_tokens, stop, ignore_eos, ...) cannot tell its zero value
# from unset on the wire, so sending a zero there would only create an empty sub-message.
_SAMPLING_KNOBS = _knobs(generate_pb2.SamplingParams, (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "logit_bias", "n"))
_STOPPING_KNOBS = _knobs(generate_pb2.StoppingCriteria, (
    "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_string"))
_OUTPUT_KNOBS = _knobs(generate_pb2.OutputOptions, (
    "logprobs", "prompt_logprobs", "return_text", "skip_special_tokens"))


def _knobs_to_send(params: GenerateParams, knobs: tuple[tuple[str, bool], ...]) -> dict[str, Any]:
    """The knobs that are set: not None, and not zero or empty where the field has no presence."""
    return {name: value for name, has_presence in knobs
            if (value := getattr(params, name)) is not None and (has_presence or value)}


def structured_output_message(constraint: StructuredOutput) -> generate_pb2.StructuredOutput:
    """A constraint -> the ``StructuredOutput`` message, exactly one member of its ``kind`` oneof set."""
    if isinstance(constraint, JsonSchema):
        return generate_pb2.StructuredOutput(json_schema=constraint.text)
    if isinstance(constraint, JsonObject):
        return generate_pb2.StructuredOutput(json_object=generate_pb2.JsonObject())
    if isinstance(constraint, Regex):
        return generate_pb2.StructuredOutput(regex=constraint.pattern)
    if isinstance(constraint, Grammar):
        return generate_pb2.StructuredOutput(grammar=constraint.lark)
    if isinstance(constraint, Choice):
        return generate_pb2.StructuredOutput(choice=generate_pb2.Choice(choices=constraint.options))
    # NOTE: the last member of the union; GenerateParams refused any other type.
    tags = [generate_pb2.StructuralTagItem(begin=t.begin, json_schema=t.text, end=t.end)
            for t in constraint.tags]
    return generate_pb2.StructuredOutput(
        structural_tag=generate_pb2.StructuralTag(tags=tags, triggers=constraint.triggers))


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
    sampling = _knobs_to_send(params, _SAMPLING_KNOBS)
    stopping = _knobs_to_send(params, _STOPPING_KNOBS)
    output = _knobs_to_send(params, _OUTPUT_KNOBS)
    # NOTE: None leaves a field unset; a sub-message is built only when one of its knobs is sent.
    req = generate_pb2.GenerateRequest(
        request_id=request_id,
        stream=stream,
        add_special_tokens=params.add_special_tokens,
        sampling=generate_pb2.SamplingParams(**sampling) if sampling else None,
        stopping=generate_pb2.StoppingCriteria(**stopping) if stopping else None,
        output=generate_pb2.OutputOptions(**output) if output else None,
        structured_output=(structured_output_message(params.structured_output)
                           if params.structured_output is not None else None),
        cache_salt=params.cache_salt or "",
        priority=params.priority or 0,
        adapter=params.adapter or "",
    )
    if token_ids is not None:
        if len(token_ids) == 0:
            raise ValueError("token_ids must not be empty")
        req.token_ids.ids.extend(token_ids)
    elif messages is not None:
        _fill_chat(req.chat, messages, params.add_generation_prompt)
    else:
        req.text = prompt  # type: ignore[assignment]  # _one_input guarantees a str here
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
