"""vllm.grpc.engine.GenerateRequest (smg-grpc-proto `_pb2`) -> our GenerateRequest.

Proto3 leaves unset scalars at zero; like vLLM's own servicer we read 0 as "default" where 0 is not a
meaningful value (top_p, repetition_penalty, n) and use the `optional` presence bits elsewhere.

Structured outputs: SamplingParams' `constraint` oneof -> our StructuredOutput, whose `field_name` is the
oneof member's own (flat) name, so that a constraint the engine cannot compile is refused (INVALID_ARGUMENT)
with "json_schema: ...", "grammar: ..." and so on, as this service names every other field.
"""

from __future__ import annotations

import uuid
from typing import Any

from engine_server.api.text_input import Tokenization, check_text_fits, string_field_size
from engine_server.frontend.outputs import GenerateRequest
from engine_server.frontend.types import (
    RequestError,
    SamplingParams,
    StructuredOutput,
    StructuredOutputKind,
)

from .engine_handle import TokenizerLike

# NOTE: requests of this service live in the engine's request-id space beside engine.v1's; the prefix keeps a
# gateway's ids from colliding with (or aborting) a direct client's.
ENGINE_ID_PREFIX = "vllm:"


def engine_request_id(request_id: str) -> str:
    return ENGINE_ID_PREFIX + request_id


# The constraints whose text is the spec as it came (json_object and choice have none)
_SPEC_KINDS = {
    "json_schema": StructuredOutputKind.JSON_SCHEMA,
    "regex": StructuredOutputKind.REGEX,
    # NOTE: vLLM takes EBNF (xgrammar's GBNF) or, with its guidance backend, Lark; the engine takes Lark
    # (llguidance's dialect) and converts a GBNF grammar (one that defines `root ::=`) where it compiles it.
    "grammar": StructuredOutputKind.GRAMMAR,
    # NOTE: JSON, in vLLM's legacy form ({"structures": [...], "triggers": [...]}) or xgrammar's
    # ({"type": "structural_tag", "format": {...}}; smg 1.13 sends {"format": {...}} alone, for the tool
    # parsers that have structural tags); the engine converts it where it compiles the constraint.
    "structural_tag": StructuredOutputKind.STRUCTURAL_TAG_JSON,
}


def structured_output_from_proto(params: Any) -> StructuredOutput | None:
    """SamplingParams' `constraint` oneof -> our StructuredOutput; None when there is none.

    NOTE: `grammar_from_first_token` needs nothing here: our engine runs no reasoning parser, so a constraint
    always applies from the first generated token, which is what that flag asks for (GetServerInfo reports
    constrained_decoding_start "first_token").
    """
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        # NOTE: a bool in the oneof: false is "set" on the wire but asks for nothing.
        if not params.json_object:
            return None
        return StructuredOutput(StructuredOutputKind.JSON_OBJECT, field_name=kind)
    if kind == "choice":
        return StructuredOutput(StructuredOutputKind.CHOICE, choices=tuple(params.choice.choices),
                                field_name=kind)
    return StructuredOutput(_SPEC_KINDS[kind], spec=getattr(params, kind), field_name=kind)


def sampling_params_from_proto(params: Any) -> SamplingParams:
    """Raises RequestError for values our engine does not serve (the message names the field)."""
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name) and getattr(params, name) < 0:
            raise RequestError(name, "-1 (all tokens) is not supported; ask for at most 20")
    return SamplingParams(
        n=params.n or 1,
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty or 1.0,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed if params.HasField("seed") else None,
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in params.logit_bias.items())),
        min_tokens=params.min_tokens,
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        prompt_logprobs=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
    )


def text_tokenization(
    request: Any, *, tokenizer: TokenizerLike, max_model_len: int
) -> Tokenization[list[int]] | None:
    """A `text` prompt's tokenization (None for the gateway's token ids). Text that cannot fit in the context
    is refused before it is tokenized, unless the request truncates its prompt (then any text can fit)."""
    if request.WhichOneof("input") != "text":
        return None
    size = string_field_size(request, "text")
    if not request.sampling_params.HasField("truncate_prompt_tokens"):
        check_text_fits(size, field="text", max_tokens=max_model_len,
                        max_token_bytes=tokenizer.max_token_bytes)
    return Tokenization(lambda: tokenizer.encode_ids(request.text, add_special_tokens=True), size)


def prompt_ids_from_proto(request: Any, *, tokenizer: TokenizerLike, max_model_len: int,
                          text_ids: list[int] | None = None) -> tuple[int, ...]:
    """The prompt: the gateway's `tokenized.input_ids` (or `text`, tokenized here unless `text_ids` are its
    ids already), truncated if asked."""
    which = request.WhichOneof("input")
    if which == "tokenized":
        ids = tuple(request.tokenized.input_ids)
    elif which == "text":
        if text_ids is None:
            tokenization = text_tokenization(request, tokenizer=tokenizer, max_model_len=max_model_len)
            assert tokenization is not None  # (text input)
            text_ids = tokenization.run()
        ids = tuple(text_ids)
    else:
        raise RequestError("input", "one of tokenized or text is required")
    if not ids:
        raise RequestError("input", "the prompt must not be empty")
    params = request.sampling_params
    if params.HasField("truncate_prompt_tokens"):
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = max_model_len
        if keep < 1:
            raise RequestError("truncate_prompt_tokens", f"must be >= 1 or -1 (model maximum), got {keep}")
        ids = ids[-keep:]  # NOTE: vLLM keeps the end of the prompt (the part next to the generation)
    return ids


def reject_unsupported_inputs(request: Any) -> None:
    """Multimodal inputs and PD (KV-transfer) requests: this is a text-only, single-stage engine."""
    for name in ("mm_inputs", "media_refs", "kv_transfer_params"):
        if request.HasField(name):
            raise RequestError(name, "not supported by this engine (text-only, no prefill/decode split)")
    if request.extra_mm_inputs:
        raise RequestError("extra_mm_inputs", "not supported by this engine (text-only)")
    if request.HasField("kv_transfer_params_json"):
        raise RequestError("kv_transfer_params_json", "not supported (no prefill/decode split)")


def generate_request_from_proto(
    request: Any, *, tokenizer: TokenizerLike, max_model_len: int, text_ids: list[int] | None = None
) -> GenerateRequest:
    """`text_ids`: a text prompt's ids from its `text_tokenization` (run off the event loop)."""
    reject_unsupported_inputs(request)
    params = request.sampling_params
    stop = tuple(params.stop)
    return GenerateRequest(
        request_id=engine_request_id(request.request_id or uuid.uuid4().hex),
        prompt_token_ids=prompt_ids_from_proto(request, tokenizer=tokenizer, max_model_len=max_model_len,
                                               text_ids=text_ids),
        params=sampling_params_from_proto(params),
        stop=stop,
        include_stop_str_in_output=params.include_stop_str_in_output,
        # NOTE: the gateway detokenizes itself; text is only needed here to match stop strings.
        detokenize=bool(stop),
        skip_special_tokens=params.skip_special_tokens,
        structured_output=structured_output_from_proto(params),
    )
