"""The engine's public vocabulary: what goes into the engine core and what comes out.

NOTE: plain dataclasses only (no torch, no protobuf) so they cross the process boundary
by pickle and the API layer can build them without importing torch.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field, fields


class FinishReason(enum.Enum):
    """Why a completion ended."""

    STOP = "stop"  # EOS, a stop token id, or (frontend) a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by a client, a disconnect, a deadline or shutdown
    ERROR = "error"  # the engine failed while the request was running
    DEAD_END = "dead_end"  # the structured-output constraint allowed no next token


class RequestError(ValueError):
    """A request that the engine refuses before admission; the message names the field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name
        self.detail = message


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the caller should retry later."""


class EngineDead(RuntimeError):
    """The engine core failed or is shutting down; no request can be served."""


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise RequestError(name, f"must be a finite number, got {value!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling and stopping knobs that the engine core applies on the logits.

    Defaults follow vLLM/OpenAI. Stop *strings* are not here: they are matched on text,
    which lives on the frontend side of the engine boundary.
    """

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # > 0, 1 = off (applies to prompt and output tokens)
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    seed: int | None = None  # None = nondeterministic
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to the logit)
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens exist
    max_tokens: int | None = None  # None = until max_model_len
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; k >= 0: sampled token's logprob + top-k alternatives
    prompt_logprobs: int | None = None  # same, for every prompt token after the first

    def __post_init__(self) -> None:
        # NOTE: vocabulary-dependent checks (token ids < vocab size, max_tokens vs
        # max_model_len) need the model config and live in the engine's validator.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            _check_finite(name, getattr(self, name))
        if self.n < 1:
            raise RequestError("n", f"must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise RequestError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise RequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise RequestError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        for token_id, bias in self.logit_bias:
            _check_finite(f"logit_bias[{token_id}]", bias)
            if not -100 <= bias <= 100:
                raise RequestError(f"logit_bias[{token_id}]", f"must be in [-100, 100], got {bias}")
        if self.min_tokens < 0:
            raise RequestError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            if self.max_tokens < 1:
                raise RequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
            if self.min_tokens > self.max_tokens:
                raise RequestError("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise RequestError(name, f"must be in [0, 20], got {value}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def __reduce__(self) -> tuple[Callable[[tuple[object, ...]], SamplingParams], tuple[tuple[object, ...]]]:
        # NOTE: pickled once per request to the engine core (a slots dataclass's __getstate__/__setstate__
        # call fields() on both ends): the values travel as one tuple, and the core builds each combination
        # once (clients send the same few), where the constructor's checks cost ~9 us a request.
        return _unpickle_sampling_params, (_sampling_values(self),)


_sampling_values = operator.attrgetter(*(f.name for f in fields(SamplingParams)))
_UNPICKLED_PARAMS: dict[tuple[object, ...], SamplingParams] = {}
_MAX_UNPICKLED_PARAMS = 256


def _unpickle_sampling_params(values: tuple[object, ...]) -> SamplingParams:
    """The SamplingParams of these field values: built (and checked) the first time, shared after that (they
    are frozen). Bounded: cleared when full."""
    params = _UNPICKLED_PARAMS.get(values)
    if params is None:
        params = SamplingParams(*values)  # type: ignore[arg-type]
        if len(_UNPICKLED_PARAMS) >= _MAX_UNPICKLED_PARAMS:
            _UNPICKLED_PARAMS.clear()
        _UNPICKLED_PARAMS[values] = params
    return params


class StructuredOutputKind(enum.Enum):
    """The language a StructuredOutput constrains completions to."""

    JSON_SCHEMA = "json_schema"  # spec: a JSON Schema as text
    JSON_OBJECT = "json_object"  # any JSON object (no spec)
    REGEX = "regex"  # spec: a regular expression the whole output matches
    GRAMMAR = "grammar"  # spec: a Lark grammar (llguidance's dialect)
    CHOICE = "choice"  # choices: the output is exactly one of them
    STRUCTURAL_TAG = "structural_tag"  # tags + triggers: tool calls constrained inside free text
    # spec: a structural tag as JSON, in vLLM's form ({"structures": [...], "triggers": [...]}) or xgrammar's
    # ({"type": "structural_tag", "format": {...}}); what the vLLM-compatible service receives
    STRUCTURAL_TAG_JSON = "structural_tag_json"


# NOTE: bounds a client's constraint before anything parses it (the contract's documented limit).
MAX_STRUCTURED_OUTPUT_BYTES = 65_536
MAX_CHOICES = 4096
MAX_STRUCTURAL_TAGS = 256


@dataclass(frozen=True, slots=True)
class StructuralTagItem:
    """One tool-call tag: `begin`, then JSON matching `json_schema` ("" = any JSON value), then `end`."""

    begin: str
    json_schema: str = ""
    end: str = ""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on every completion of a request (constrained decoding); compiled by the engine core.

    `field_name` is the request field that carried it, so that errors found while compiling name what the
    client sent. The shape is checked here (cheap, at the edge); the language itself where it compiles.
    """

    kind: StructuredOutputKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    tags: tuple[StructuralTagItem, ...] = ()
    triggers: tuple[str, ...] = ()
    field_name: str = ""

    def __post_init__(self) -> None:
        name = self.field_name or self.kind.value
        kind = self.kind
        size = len(self.spec.encode()) + sum(len(c.encode()) for c in self.choices) + sum(
            len(t.encode()) for t in self.triggers) + sum(
            len(t.begin.encode()) + len(t.json_schema.encode()) + len(t.end.encode()) for t in self.tags)
        if size > MAX_STRUCTURED_OUTPUT_BYTES:
            raise RequestError(name, f"is {size} bytes; at most {MAX_STRUCTURED_OUTPUT_BYTES} are allowed")
        takes_spec = kind in (StructuredOutputKind.JSON_SCHEMA, StructuredOutputKind.REGEX,
                              StructuredOutputKind.GRAMMAR, StructuredOutputKind.STRUCTURAL_TAG_JSON)
        if takes_spec and not self.spec.strip():
            raise RequestError(name, "must not be empty")
        if kind is StructuredOutputKind.CHOICE:
            if not self.choices:
                raise RequestError(name, "needs at least one choice")
            if len(self.choices) > MAX_CHOICES:
                raise RequestError(name, f"at most {MAX_CHOICES} choices, got {len(self.choices)}")
            if not all(self.choices):
                raise RequestError(name, "each choice must be a non-empty string")
        if kind is StructuredOutputKind.STRUCTURAL_TAG:
            if not self.tags:
                raise RequestError(f"{name}.tags", "needs at least one tag")
            if len(self.tags) > MAX_STRUCTURAL_TAGS:
                raise RequestError(f"{name}.tags", f"at most {MAX_STRUCTURAL_TAGS}, got {len(self.tags)}")
            if not self.triggers or not all(self.triggers):
                raise RequestError(f"{name}.triggers", "needs at least one trigger, each non-empty")
            for i, tag in enumerate(self.tags):
                if not any(tag.begin.startswith(trigger) for trigger in self.triggers):
                    raise RequestError(f"{name}.tags[{i}].begin",
                                       f"{tag.begin!r} does not start with any of the triggers")


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the engine core sees it: token ids in, n completions out."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    structured_output: StructuredOutput | None = None
    # The prefix cache's namespace: requests with different salts never share KV blocks ("" = shared).
    cache_salt: str = ""
    # Lower is served first (vLLM's convention); equal priorities first come, first served.
    priority: int = 0
    # The LoRA adapter (a loaded adapter's name) the request runs with; "" = the base model.
    adapter: str = ""

    def __reduce__(self) -> tuple[type[EngineRequest], tuple[object, ...]]:
        return EngineRequest, (self.request_id, self.prompt_token_ids, self.params, self.structured_output,
                               self.cache_salt, self.priority, self.adapter)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one token, with the top alternatives at that position.

    NOTE: log_softmax of the RAW model logits, before temperature, penalties, logit_bias and
    top-k/top-p/min-p (vLLM's default "raw_logprobs"), so with a bias or penalty the chosen
    token need not have rank 1.
    """

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(slots=True)
class CompletionDelta:
    """What one step produced for one completion (sequence) of a request.

    The engine emits at most one delta per completion per step. `prompt_logprobs`
    and the prompt counts ride on the first delta of index 0.
    """

    request_id: str
    index: int  # which of the n completions
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # aligned with new_token_ids when asked
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the EOS/stop token that ended it, if any
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first prompt token has none
    error: str | None = None  # set with FinishReason.ERROR

    @property
    def is_plain(self) -> bool:
        """New tokens of completion 0 and nothing else (the commonest delta by far)."""
        return (self.index == 0 and self.logprobs is None and self.finish_reason is None
                and self.stop_token_id is None and not self.num_prompt_tokens
                and not self.num_cached_prompt_tokens and self.prompt_logprobs is None and self.error is None)

    def __reduce__(self) -> tuple[type[CompletionDelta], tuple[object, ...]]:
        # NOTE: a slots dataclass unpickles through dataclasses' __setstate__, which calls fields() per
        # object; a constructor call is several times cheaper. (Plain deltas do not come this way at all:
        # StepOutput carries them as columns.)
        return CompletionDelta, (
            self.request_id, self.index, self.new_token_ids, self.logprobs, self.finish_reason,
            self.stop_token_id, self.num_prompt_tokens, self.num_cached_prompt_tokens, self.prompt_logprobs,
            self.error,
        )


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A cheap snapshot for load reporting.

    NOTE: requests, not completions: a request with n = 8 is one request (running while any of its
    completions is), and up to eight running completions (sequences: what max_num_seqs bounds).
    """

    num_running: int  # requests with a completion in the running batch
    num_waiting: int  # the other admitted requests (queued, preempted, or waiting for their grammar)
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_running_completions: int = 0  # sequences in the running batch

    @property
    def kv_cache_usage(self) -> float:
        if self.num_total_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks
