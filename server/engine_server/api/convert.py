"""protobuf -> engine dataclasses: validation with proto field names and the contract's defaults.

The one place that reads request messages. Every error is a RequestError naming the proto field
("sampling.top_p: must be in (0, 1]"); unset `optional` fields take the defaults written in the .proto.
The reverse direction (engine outputs -> response messages) is in `responses.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine_server.api.text_input import Tokenization, check_text_fits, nested_string_sizes, string_field_size
from engine_server.frontend.outputs import GenerateRequest
from engine_server.frontend.types import (
    RequestError,
    SamplingParams,
    StructuralTagItem,
    StructuredOutput,
    StructuredOutputKind,
)

if TYPE_CHECKING:
    from engine_proto.engine.v1 import embed_pb2, generate_pb2, tokenize_pb2

    from engine_server.api.handle import TokenizerHandle
    from engine_server.frontend.types import ModelInfo

MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256  # GenerateRequest.cache_salt
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_EMBED_INPUTS = 256
# NOTE: one Embed runs as one engine command, which holds the core (256 inputs of 2048 tokens held one for
# 80 s). 16384 tokens is 64 inputs of MiniLM's 256: ~3 s on two CPU cores, a fraction of a second on a GPU.
MAX_EMBED_TOKENS = 16384
MAX_ABORT_IDS = 1024

# SamplingParams validates its own ranges with the engine's names; these are their proto paths.
_PROTO_FIELD = {
    "n": "sampling.n", "temperature": "sampling.temperature", "top_p": "sampling.top_p",
    "top_k": "sampling.top_k", "min_p": "sampling.min_p", "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty", "frequency_penalty": "sampling.frequency_penalty",
    "min_tokens": "stopping.min_tokens", "max_tokens": "stopping.max_tokens",
    "logprobs": "output.logprobs", "prompt_logprobs": "output.prompt_logprobs",
}


def proto_field_name(engine_field: str) -> str:
    """The proto path of an engine field name (`logit_bias[5]` -> `sampling.logit_bias[5]`)."""
    if engine_field.startswith("logit_bias"):
        return "sampling." + engine_field
    return _PROTO_FIELD.get(engine_field, engine_field)


def _renamed(error: RequestError) -> RequestError:
    name = proto_field_name(error.field_name)
    message = str(error).removeprefix(f"{error.field_name}: ")
    return RequestError(name, message)


def check_token_ids(ids: Sequence[int], *, field: str, vocab_size: int) -> None:
    # NOTE: max() runs in C; only a bad request pays for the search of the offending position.
    if ids and max(ids) >= vocab_size:
        position = next(i for i, token_id in enumerate(ids) if token_id >= vocab_size)
        raise RequestError(f"{field}[{position}]",
                           f"{ids[position]} is outside the vocabulary (size {vocab_size})")


def chat_tokenization(chat: generate_pb2.ChatMessages, tokenizer: TokenizerHandle, *, field: str,
                      max_tokens: int) -> Tokenization[list[int]]:
    """Render with the chat template, bound the rendering as a text, tokenize it without special tokens.

    NOTE: the conversation is read in `run()` (off the loop for a long one); only the rendering can be bounded
    (a template may leave text out: reasoning of earlier turns, say), so it is read and rendered first.
    """
    if not chat.messages:
        raise RequestError(f"{field}.messages", "at least one message is required")

    def run() -> list[int]:
        turns = []
        for i, message in enumerate(chat.messages):
            if not message.role:
                raise RequestError(f"{field}.messages[{i}].role", "is required")
            turns.append((message.role, message.content))
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        try:
            rendered = tokenizer.render_chat(turns, add_generation_prompt=add_generation_prompt)
        except RequestError as exc:
            raise RequestError(f"{field}.messages", str(exc).removeprefix(f"{exc.field_name}: ")) from None
        size = len(rendered) if rendered.isascii() else len(rendered.encode())
        check_text_fits(size, field=field, max_tokens=max_tokens, max_token_bytes=tokenizer.max_token_bytes)
        return tokenizer.encode_ids(rendered, add_special_tokens=False)

    return Tokenization(run, len(chat.SerializeToString()))


def _check_generation_model(model_info: ModelInfo) -> None:
    if model_info.task != "generate":
        raise RequestError("model", "the served model is an embedding model; use Embed")


def prompt_tokenization(
    msg: generate_pb2.GenerateRequest, *, tokenizer: TokenizerHandle, model_info: ModelInfo
) -> Tokenization[list[int]] | None:
    """A text or chat prompt's tokenization (None for token ids: `to_generate_request` takes them as they
    are). Text that cannot fit in the context is refused here, from its size, before it is read."""
    kind = msg.WhichOneof("input")
    if kind == "token_ids":
        return None
    _check_generation_model(model_info)
    max_len = model_info.max_model_len
    if kind == "text":
        size = string_field_size(msg, "text")
        check_text_fits(size, field="text", max_tokens=max_len, max_token_bytes=tokenizer.max_token_bytes)
        add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
        return Tokenization(lambda: tokenizer.encode_ids(msg.text, add_special_tokens=add_special), size)
    if kind == "chat":
        return chat_tokenization(msg.chat, tokenizer, field="chat", max_tokens=max_len)
    raise RequestError("input", "exactly one of token_ids, text or chat must be set")


def _prompt_ids(msg: generate_pb2.GenerateRequest, tokenizer: TokenizerHandle, model_info: ModelInfo,
                prompt: list[int] | None) -> list[int]:
    kind = msg.WhichOneof("input")
    if kind == "token_ids":
        ids = msg.token_ids.ids[:]  # (a list; upb's slice is ~1 us faster than list() for 100 ids)
        check_token_ids(ids, field="token_ids.ids", vocab_size=model_info.vocab_size)
        field = "token_ids.ids"
    elif prompt is not None:
        ids, field = prompt, kind or "input"
    else:
        tokenization = prompt_tokenization(msg, tokenizer=tokenizer, model_info=model_info)
        assert tokenization is not None  # (None only for token ids)
        ids, field = tokenization.run(), kind or "input"
    if not ids:
        raise RequestError(field, "the prompt must have at least one token")
    return ids


# Fields of the request's SamplingParams / StoppingCriteria / OutputOptions that map one to one onto the
# engine's SamplingParams (same names); whatever the client left unset keeps the engine's default.
_SAMPLING_FIELDS = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed",
})
_STOPPING_FIELDS = frozenset({"max_tokens", "min_tokens", "ignore_eos"})
_OUTPUT_FIELDS = frozenset({"logprobs", "prompt_logprobs"})


# SamplingParams is frozen: requests that set the same knobs to the same values share one (clients send the
# same few combinations). Keyed by the (field, value) pairs ListFields() returned, scalar values only: a set
# repeated or map field (stop strings, stop ids, logit bias) makes a request build its own. Bounded.
_KEPT_PARAMS: dict[tuple[Any, ...], SamplingParams] = {}
_MAX_KEPT_PARAMS = 256
_SCALAR_TYPES = frozenset({int, float, bool, str})


def _sampling_params(msg: generate_pb2.GenerateRequest, stopping: Sequence[tuple[Any, Any]], *,
                     vocab_size: int) -> SamplingParams:
    # NOTE: ListFields() names only what the client set (one C call), where a HasField() per knob cost ~20 us
    # per request; explicit presence is kept (an optional field set to 0 is listed). `stopping`: the
    # request's msg.stopping.ListFields(), shared with _stop_strings.
    sampling, output = msg.sampling.ListFields(), msg.output.ListFields()
    key = (vocab_size, *sampling, None, *stopping, None, *output)
    try:
        params = _KEPT_PARAMS.get(key)
    except TypeError:  # a set repeated field (its value is unhashable)
        params = None
    if params is not None:
        return params
    params = _new_sampling_params(sampling, stopping, output, vocab_size=vocab_size)
    if all(type(value) in _SCALAR_TYPES for fields in (sampling, stopping, output) for _, value in fields):
        if len(_KEPT_PARAMS) >= _MAX_KEPT_PARAMS:
            _KEPT_PARAMS.clear()
        _KEPT_PARAMS[key] = params
    return params


def _new_sampling_params(sampling: Sequence[tuple[Any, Any]], stopping: Sequence[tuple[Any, Any]],
                         output: Sequence[tuple[Any, Any]], *, vocab_size: int) -> SamplingParams:
    kwargs: dict[str, Any] = {}
    for descriptor, value in sampling:
        name = descriptor.name
        if name in _SAMPLING_FIELDS:
            kwargs[name] = value
        elif name == "logit_bias":
            for token_id in value:
                if token_id >= vocab_size:
                    raise RequestError(f"sampling.logit_bias[{token_id}]",
                                       f"token id is outside the vocabulary (size {vocab_size})")
            kwargs["logit_bias"] = tuple(sorted(value.items()))
    n = kwargs.get("n", 1)
    if not 1 <= n <= MAX_N:
        raise RequestError("sampling.n", f"must be in [1, {MAX_N}], got {n}")
    for descriptor, value in stopping:
        name = descriptor.name
        if name in _STOPPING_FIELDS:
            kwargs[name] = value
        elif name == "stop_token_ids":
            check_token_ids(value, field="stopping.stop_token_ids", vocab_size=vocab_size)
            kwargs["stop_token_ids"] = tuple(value)
    for descriptor, value in output:
        if descriptor.name in _OUTPUT_FIELDS:
            kwargs[descriptor.name] = value
    try:
        return SamplingParams(**kwargs)
    except RequestError as exc:
        raise _renamed(exc) from None


def _stop_strings(stopping: Sequence[tuple[Any, Any]]) -> tuple[str, ...]:
    """The stop strings among the set fields of a StoppingCriteria (most requests have none: no container
    is built for them)."""
    stops: tuple[str, ...] = next((tuple(value) for field, value in stopping if field.name == "stop"), ())
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError("stopping.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for i, stop in enumerate(stops):
        if not 1 <= len(stop) <= MAX_STOP_STRING_CHARS:
            raise RequestError(f"stopping.stop[{i}]",
                               f"must be 1 to {MAX_STOP_STRING_CHARS} characters, got {len(stop)}")
    return stops


def to_generate_request(
    msg: generate_pb2.GenerateRequest, *, tokenizer: TokenizerHandle, model_info: ModelInfo,
    prompt: list[int] | None = None,
) -> GenerateRequest:
    """Validate a GenerateRequest and build the engine's request (assigning an id when none was sent).

    `prompt`: a text or chat prompt's token ids from its `prompt_tokenization` (run off the event loop);
    without them such a prompt is tokenized here.
    """
    request_id = msg.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise RequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    _check_generation_model(model_info)
    stopping = msg.stopping.ListFields()
    params = _sampling_params(msg, stopping, vocab_size=model_info.vocab_size)
    stops = _stop_strings(stopping)
    prompt = _prompt_ids(msg, tokenizer, model_info, prompt)
    max_len = model_info.max_model_len
    if len(prompt) >= max_len:
        raise RequestError(msg.WhichOneof("input") or "input",
                           f"the prompt has {len(prompt)} tokens; the context length is {max_len}")
    if params.max_tokens is not None and len(prompt) + params.max_tokens > max_len:
        raise RequestError("stopping.max_tokens",
                           f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                           f"context length {max_len}")
    out = msg.output
    constraint = structured_output(msg.structured_output) if msg.HasField("structured_output") else None
    if (num_salt_chars := len(msg.cache_salt)) > MAX_CACHE_SALT_CHARS:
        raise RequestError("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters, got {num_salt_chars}")
    return GenerateRequest(
        cache_salt=msg.cache_salt,
        priority=msg.priority,
        adapter=msg.adapter,
        structured_output=constraint,
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        params=params,
        stop=stops,
        include_stop_str_in_output=msg.stopping.include_stop_string,
        detokenize=out.return_text if out.HasField("return_text") else True,
        skip_special_tokens=out.skip_special_tokens if out.HasField("skip_special_tokens") else True,
    )


def structured_output(msg: generate_pb2.StructuredOutput) -> StructuredOutput:
    """The request's constraint; its shape is checked here, its language where the engine compiles it."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise RequestError("structured_output", "one of json_schema, json_object, regex, grammar, choice or "
                           "structural_tag must be set")
    name = f"structured_output.{kind}"
    if kind == "choice":
        return StructuredOutput(StructuredOutputKind.CHOICE, choices=tuple(msg.choice.choices),
                                field_name=name)
    if kind == "structural_tag":
        tag = msg.structural_tag
        return StructuredOutput(
            StructuredOutputKind.STRUCTURAL_TAG, field_name=name, triggers=tuple(tag.triggers),
            tags=tuple(StructuralTagItem(t.begin, t.json_schema, t.end) for t in tag.tags))
    if kind == "json_object":
        return StructuredOutput(StructuredOutputKind.JSON_OBJECT, field_name=name)
    return StructuredOutput(StructuredOutputKind(kind), spec=getattr(msg, kind), field_name=name)


def abort_ids(msg: generate_pb2.AbortRequest) -> list[str]:
    ids = list(msg.request_ids)
    if len(ids) > MAX_ABORT_IDS:
        raise RequestError("request_ids", f"at most {MAX_ABORT_IDS} ids, got {len(ids)}")
    return ids


def embed_tokenization(
    msg: embed_pb2.EmbedRequest, *, tokenizer: TokenizerHandle, model_info: ModelInfo
) -> Tokenization[list[list[int]]]:
    """The batch's token ids, one list per input. Text that cannot fit in the model's length is refused here,
    from its size, before it is read; `run()` refuses an input without tokens or over the length, and a batch
    of more than MAX_EMBED_TOKENS tokens in all."""
    if model_info.task != "embed":
        raise RequestError("model", "the served model is a generation model; Embed needs an embedding model")
    if not 1 <= len(msg.inputs) <= MAX_EMBED_INPUTS:
        raise RequestError("inputs", f"must hold 1 to {MAX_EMBED_INPUTS} inputs, got {len(msg.inputs)}")
    add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
    max_len, max_token_bytes = model_info.max_model_len, tokenizer.max_token_bytes
    text_sizes = nested_string_sizes(msg, "inputs", "text")
    inputs: list[int | list[int]] = []  # a text input's index in msg.inputs, or an input's token ids
    for i, item in enumerate(msg.inputs):
        kind = item.WhichOneof("input")
        if kind == "text":
            check_text_fits(text_sizes[i], field=f"inputs[{i}].text", max_tokens=max_len,
                            max_token_bytes=max_token_bytes)
            inputs.append(i)
        elif kind == "token_ids":
            ids = list(item.token_ids.ids)
            check_token_ids(ids, field=f"inputs[{i}].token_ids.ids", vocab_size=model_info.vocab_size)
            inputs.append(ids)
        else:
            raise RequestError(f"inputs[{i}]", "exactly one of text or token_ids must be set")

    def run() -> list[list[int]]:
        batch = []
        for i, item in enumerate(inputs):
            if isinstance(item, int):
                ids = tokenizer.encode_ids(msg.inputs[item].text, add_special_tokens=add_special)
            else:
                ids = item
            if not ids:
                raise RequestError(f"inputs[{i}]", "must have at least one token")
            if len(ids) > max_len:
                raise RequestError(f"inputs[{i}]",
                                   f"has {len(ids)} tokens; the context length is {max_len}")
            batch.append(ids)
        num_tokens = sum(map(len, batch))
        if num_tokens > MAX_EMBED_TOKENS:
            raise RequestError("inputs",
                               f"{num_tokens} tokens in all; at most {MAX_EMBED_TOKENS} per request")
        return batch

    return Tokenization(run, sum(text_sizes))


def tokenize_tokenization(
    msg: tokenize_pb2.TokenizeRequest, *, tokenizer: TokenizerHandle, model_info: ModelInfo
) -> Tokenization[tuple[list[int], list[tuple[int, int]] | None]]:
    """Token ids and, when asked for text input, code-point offsets. Bounded as Generate's prompt is: text
    (or a rendered conversation) that cannot fit in the model's context is refused before it is tokenized."""
    kind = msg.WhichOneof("input")
    max_len = model_info.max_model_len
    if kind == "text":
        size = string_field_size(msg, "text")
        check_text_fits(size, field="text", max_tokens=max_len, max_token_bytes=tokenizer.max_token_bytes)
        add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
        if not msg.return_offsets:
            return Tokenization(
                lambda: (tokenizer.encode_ids(msg.text, add_special_tokens=add_special), None), size
            )

        def with_offsets() -> tuple[list[int], list[tuple[int, int]] | None]:
            encoding = tokenizer.encode(msg.text, add_special_tokens=add_special)
            return encoding.token_ids, encoding.offsets

        return Tokenization(with_offsets, size)
    if kind == "chat":
        chat = chat_tokenization(msg.chat, tokenizer, field="chat", max_tokens=max_len)
        return Tokenization(lambda: (chat.run(), None), chat.size)
    raise RequestError("input", "exactly one of text or chat must be set")


def detokenize_ids(msg: tokenize_pb2.DetokenizeRequest, *, vocab_size: int) -> tuple[list[int], bool]:
    ids = list(msg.token_ids)
    check_token_ids(ids, field="token_ids", vocab_size=vocab_size)
    return ids, (msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True)
