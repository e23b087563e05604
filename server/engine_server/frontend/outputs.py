"""What the API layer hands to `AsyncEngine.generate` and what it gets back."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_server.engine.types import (
    FinishReason,
    RequestError,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


class EngineState(enum.Enum):
    STARTING = "starting"  # the core is loading the model
    SERVING = "serving"
    DRAINING = "draining"  # in-flight requests finish; new ones are refused
    FAILED = "failed"  # the core died or raised; nothing is served
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation request, already tokenized."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings, matched across token boundaries on the frontend
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: chunks carry token ids only (text is "")
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # the constraint every completion follows
    cache_salt: str = ""  # the prefix cache's namespace ("" = shared): no block is shared across salts
    priority: int = 0  # lower first; first come, first served within one priority
    adapter: str = ""  # a loaded LoRA adapter's name ("" = the base model)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise RequestError("request_id", "must not be empty")
        # NOTE: the bounds keep per-token matching cheap; they are the engine.v1 contract's.
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for stop in self.stop:
            if not 1 <= len(stop) <= MAX_STOP_STRING_CHARS:
                raise RequestError("stop", f"each must have 1 to {MAX_STOP_STRING_CHARS} characters")


@dataclass(slots=True)
class CompletionChunk:
    """News for one of the n completions; everything ready since the consumer last looked."""

    index: int
    token_ids: list[int]
    text: str  # text delta ("" when detokenize=False)
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None  # the matched stop string, or the stop/EOS token id
    num_completion_tokens: int  # cumulative for this index


@dataclass(slots=True)
class GenerateOutput:
    request_id: str
    chunks: list[CompletionChunk]  # only the completions with news, by index
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None  # only on the first output that has them
    finished: bool  # all n completions finished
    error: str | None = None  # set when the engine failed this request (a chunk has FinishReason.ERROR)


# Called on the engine's output task with each output as it becomes ready (RequestStream.set_sink); True:
# delivered, the stream will not yield it; False: declined, the stream yields it, in order.
OutputSink = Callable[[GenerateOutput], bool]

# Offered before OutputSink when the news is the commonest kind: new tokens (and their text) of completion 0
# of a request still running, nothing else (no finish, logprobs, prompt logprobs or other completion). It
# gets (token_ids, text, num_completion_tokens so far), so no chunk or GenerateOutput is built for most
# messages of a stream. True: delivered; False: the same news goes to the OutputSink as an output (nothing
# may have been sent). The token id list may be kept only until the call returns.
PlainSink = Callable[[list[int], str, int], bool]
