"""Checks a request against the model at admission, in the frontend (pure Python; raises RequestError).

NOTE: the one validation of a request: the engine core does not check it again (what it still asserts guards
memory, see `LLMEngine.add_request`). `AsyncEngine` runs it before a request crosses the pipe.
"""

from __future__ import annotations

from operator import countOf

from engine_server.engine.lora.types import MAX_NAME_LENGTH as MAX_ADAPTER_NAME_LENGTH
from engine_server.engine.model_info import ModelInfo
from engine_server.engine.types import EngineRequest, RequestError, SamplingParams

MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 256  # the engine.v1 contract's bound


def _check_token_ids(field_name: str, token_ids: tuple[int, ...], vocab_size: int) -> None:
    # NOTE: the common case in C (the ids whose type() is int counted, min, max); only a bad request walks the
    # ids in Python.
    if not token_ids or (countOf(map(type, token_ids), int) == len(token_ids) and min(token_ids) >= 0
                         and max(token_ids) < vocab_size):
        return
    for i, token_id in enumerate(token_ids):
        # NOTE: bool is an int subclass; a bool token id is a caller bug, not token 0/1.
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise RequestError(field_name, f"[{i}] must be an integer token id, got {token_id!r}")
        if not 0 <= token_id < vocab_size:
            raise RequestError(field_name, f"[{i}] = {token_id} is outside the vocabulary [0, {vocab_size})")


def validate_request(request: EngineRequest, info: ModelInfo, *, max_num_seqs: int | None = None) -> None:
    """Raises RequestError naming the first field that the model (or `max_num_seqs`, the engine's sequence
    slots: a request's n completions run side by side) cannot take."""
    if not isinstance(request.request_id, str) or not request.request_id:
        raise RequestError("request_id", "must be a non-empty string")
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise RequestError("request_id", f"must be at most {MAX_REQUEST_ID_LEN} characters")
    if not isinstance(request.cache_salt, str) or len(request.cache_salt) > MAX_CACHE_SALT_LEN:
        raise RequestError("cache_salt", f"must be a string of at most {MAX_CACHE_SALT_LEN} characters")
    if not isinstance(request.adapter, str) or len(request.adapter) > MAX_ADAPTER_NAME_LENGTH:
        raise RequestError("adapter", f"must be a string of at most {MAX_ADAPTER_NAME_LENGTH} characters")
    # NOTE: bool is an int subclass; a bool priority is a caller bug.
    if type(request.priority) is not int:
        raise RequestError("priority", f"must be an integer, got {request.priority!r}")
    if info.task != "generate":
        raise RequestError("model", f"{info.model_path!r} is an embedding model; it cannot generate")
    if not isinstance(request.params, SamplingParams):
        raise RequestError("params", "must be a SamplingParams")
    prompt = request.prompt_token_ids
    if not isinstance(prompt, (tuple, list)):
        raise RequestError("prompt_token_ids", "must be a sequence of token ids")
    if not prompt:
        raise RequestError("prompt_token_ids", "must not be empty")
    _check_token_ids("prompt_token_ids", tuple(prompt), info.vocab_size)
    params = request.params
    num_prompt = len(prompt)
    if num_prompt >= info.max_model_len:
        raise RequestError("prompt_token_ids", f"has {num_prompt} tokens; the model allows at most "
                           f"{info.max_model_len - 1} (max_model_len {info.max_model_len}, one is left "
                           f"for the output)")
    if params.max_tokens is not None and num_prompt + params.max_tokens > info.max_model_len:
        raise RequestError("max_tokens", f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) "
                           f"exceeds max_model_len ({info.max_model_len})")
    if params.min_tokens > info.max_model_len - num_prompt:
        raise RequestError("min_tokens", f"{params.min_tokens} cannot fit after a {num_prompt}-token prompt "
                           f"(max_model_len {info.max_model_len})")
    _check_token_ids("stop_token_ids", params.stop_token_ids, info.vocab_size)
    if params.logit_bias:
        bias_ids = tuple(token_id for token_id, _ in params.logit_bias)
        _check_token_ids("logit_bias", bias_ids, info.vocab_size)
        if len(set(bias_ids)) != len(bias_ids):
            raise RequestError("logit_bias", "has a token id more than once")
    if max_num_seqs is not None and params.n > max_num_seqs:
        raise RequestError("n", f"must be <= max_num_seqs ({max_num_seqs}), got {params.n}")
    if params.top_k > info.vocab_size:
        raise RequestError("top_k", f"must be <= the vocabulary size ({info.vocab_size}), got {params.top_k}")
    if params.seed is not None and not -(2**63) <= params.seed < 2**64:
        raise RequestError("seed", "must fit in 64 bits")
