"""Generate knobs as one validated dataclass, and the keyword arguments that build it.

``client.generate("Hi", max_tokens=8, temperature=0.0)`` is the same as
``client.generate("Hi", params=GenerateParams(max_tokens=8, temperature=0.0))``. Every knob left at None
is left UNSET on the wire, so the server applies the contract's default; 0 and 0.0 are sent
(temperature=0.0 means greedy).

Example::

    greedy = GenerateParams(max_tokens=32, temperature=0.0, stop=["\\n\\n"])
    result = client.complete("Once upon a time", params=greedy)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypedDict

from .structured import STRUCTURED_OUTPUT_TYPES, StructuredOutput

__all__ = ["GenerateOptions", "GenerateParams"]

_MAX_UINT32 = 2**32 - 1
_MAX_UINT64 = 2**64 - 1
_MIN_INT32, _MAX_INT32 = -(2**31), 2**31 - 1


class GenerateOptions(TypedDict, total=False):
    """The keyword form of :class:`GenerateParams` (for ``**options`` of ``generate``/``complete``)."""

    max_tokens: int | None
    min_tokens: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    seed: int | None
    logit_bias: Mapping[int, float] | None
    n: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool
    include_stop_string: bool
    logprobs: int | None
    prompt_logprobs: int | None
    return_text: bool | None
    skip_special_tokens: bool | None
    add_special_tokens: bool | None
    add_generation_prompt: bool | None
    structured_output: StructuredOutput | None
    cache_salt: str | None
    priority: int | None
    adapter: str | None


def _check_uint(name: str, value: int | None, *, minimum: int = 0, maximum: int = _MAX_UINT32) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")


def _check_float(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """Sampling, stopping and output options of a Generate request (None = the server's default).

    Only types and wire ranges (unsigned ints, finite floats) are checked here; the server checks the
    contract's value ranges and answers INVALID_ARGUMENT naming the field.

    Example: ``client.complete(token_ids=ids, params=GenerateParams(max_tokens=16, temperature=0.0))``
    """

    # Stopping
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None  # a single str is one stop string, not its characters
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    include_stop_string: bool = False
    # Sampling
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    n: int | None = None
    # Output
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_text: bool | None = None
    skip_special_tokens: bool | None = None
    # Input rendering
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    # Constrained decoding: JsonSchema, JsonObject, Regex, Grammar, Choice or StructuralTag (None: free text)
    structured_output: StructuredOutput | None = None
    # Scheduling and caching
    # The prefix cache's namespace: requests with different salts never share cached KV (None / "": shared).
    cache_salt: str | None = None
    # Lower is served first; equal priorities first come, first served (None: the server's default, 0).
    priority: int | None = None
    # The LoRA adapter to generate with (a loaded adapter's name; None / "": the base model).
    adapter: str | None = None

    def __post_init__(self) -> None:
        _check_uint("max_tokens", self.max_tokens, minimum=1)
        _check_uint("min_tokens", self.min_tokens)
        _check_uint("top_k", self.top_k)
        _check_uint("n", self.n, minimum=1)
        _check_uint("seed", self.seed, maximum=_MAX_UINT64)
        _check_uint("logprobs", self.logprobs)
        _check_uint("prompt_logprobs", self.prompt_logprobs)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            _check_float(name, getattr(self, name))
        # NOTE: normalise to tuples so the frozen object is really immutable (and hashable where possible).
        if self.stop is not None:
            stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
            if not all(isinstance(s, str) for s in stops):
                raise TypeError("stop must be a str or a sequence of str")
            object.__setattr__(self, "stop", stops)
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            for token_id in ids:
                _check_uint("stop_token_ids[]", token_id)
            object.__setattr__(self, "stop_token_ids", ids)
        if self.logit_bias is not None:
            bias = dict(self.logit_bias)
            for token_id, value in bias.items():
                _check_uint("logit_bias key", token_id)
                _check_float("logit_bias value", value)
            object.__setattr__(self, "logit_bias", bias)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(f"cache_salt must be a str, got {type(self.cache_salt).__name__}")
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise TypeError(f"adapter must be a str, got {type(self.adapter).__name__}")
        priority = self.priority
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                     or not _MIN_INT32 <= priority <= _MAX_INT32):
            raise ValueError(f"priority must be an int32, got {priority!r}")
        constraint = self.structured_output
        if constraint is not None and not isinstance(constraint, STRUCTURED_OUTPUT_TYPES):
            # (an OpenAI-style dict such as {"type": "json_object"} lands here: say what to pass instead)
            raise TypeError("structured_output must be a JsonSchema, JsonObject, Regex, Grammar, Choice or "
                            f"StructuralTag (engine_client.structured), got {type(constraint).__name__}")


def merge_params(params: GenerateParams | None, options: Mapping[str, object]) -> GenerateParams:
    """``params=`` plus keyword knobs (the keywords win)."""
    if params is None:
        return GenerateParams(**options)  # type: ignore[arg-type]
    if not options:
        return params
    return replace(params, **options)  # type: ignore[arg-type]
