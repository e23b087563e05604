"""Small typed result objects returned by both clients (frozen, slotted; no protobuf in sight).

Example::

    async for chunk in client.generate("Hello", max_tokens=8):
        print(chunk.index, chunk.token_ids, chunk.text, chunk.finish_reason)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .adapters import AdapterInfo

__all__ = [
    "Completion",
    "EmbedResult",
    "Embedding",
    "EngineState",
    "FinishReason",
    "GenerateChunk",
    "GenerateResult",
    "HealthStatus",
    "Load",
    "ModelInfo",
    "ModelTask",
    "ServerInfo",
    "ServerLimits",
    "TokenLogprob",
    "TokenizeResult",
    "TopLogprob",
    "Usage",
]


class FinishReason(str, enum.Enum):
    """Why a completion ended."""

    STOP = "stop"  # end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # Abort RPC, cancelled call, deadline or server shutdown
    # structured_output allowed no next token: the output is a valid but incomplete prefix of its language
    CONSTRAINT_DEAD_END = "constraint_dead_end"
    UNKNOWN = "unknown"  # a reason this client version does not know (a newer server)


class EngineState(str, enum.Enum):
    """The server engine's life cycle."""

    UNSPECIFIED = "unspecified"
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"


class ModelTask(str, enum.Enum):
    """What the loaded model serves."""

    UNSPECIFIED = "unspecified"
    GENERATE = "generate"
    EMBED = "embed"


class HealthStatus(str, enum.Enum):
    """A grpc.health.v1 serving status."""

    UNKNOWN = "unknown"
    SERVING = "serving"
    NOT_SERVING = "not_serving"
    SERVICE_UNKNOWN = "service_unknown"


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One alternative token at a position."""

    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability (natural log, before sampling filters) of one token, with the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request (all completions together)."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    """New output of one completion (``index``) of a Generate request.

    ``finish_reason`` is None while the completion runs and set exactly once, in its last chunk; ``stop`` is
    the matched stop string (str) or stop token id (int) when it finished with STOP; ``usage`` is set only on
    the last chunk of the whole request; ``prompt_logprobs`` only on the first chunk, when asked for.

    Example: ``text = "".join(c.text for c in client.generate("Hi", max_tokens=8) if c.index == 0)``
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    stop: str | int | None = None
    usage: Usage | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class Completion:
    """One whole completion of a request."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    stop: str | int | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """The whole result of a Generate request: every completion (by index) and the usage.

    Example::

        result = client.complete("Hello", max_tokens=8, temperature=0.0)
        print(result.text, result.completions[0].finish_reason, result.usage.completion_tokens)
    """

    request_id: str
    completions: tuple[Completion, ...]
    usage: Usage | None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def text(self) -> str:
        """The text of completion 0 (the only one unless n > 1)."""
        return self.completions[0].text if self.completions else ""

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The token ids of completion 0."""
        return self.completions[0].token_ids if self.completions else ()

    @property
    def finish_reason(self) -> FinishReason | None:
        """The finish reason of completion 0."""
        return self.completions[0].finish_reason if self.completions else None


@dataclass(frozen=True, slots=True)
class Embedding:
    """The vector of one input."""

    values: tuple[float, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class EmbedResult:
    """One vector per input, in input order."""

    embeddings: tuple[Embedding, ...]
    usage: Usage | None

    @property
    def vectors(self) -> list[list[float]]:
        """The vectors as plain lists (for numpy: ``np.asarray(result.vectors)``)."""
        return [list(e.values) for e in self.embeddings]


@dataclass(frozen=True, slots=True)
class TokenizeResult:
    """Token ids of a text; ``offsets[i]`` (when asked) is the [start, end) code-point span of token i."""

    token_ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The loaded model."""

    served_model_name: str
    model_path: str
    architecture: str
    task: ModelTask
    max_context_length: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    dtype: str
    embedding_dimension: int
    num_parameters: int
    has_chat_template: bool
    device: str
    adapters: tuple[AdapterInfo, ...] = ()  # the LoRA adapters loaded now


@dataclass(frozen=True, slots=True)
class Load:
    """The engine's current work. Counts are of requests (one with n > 1 counts once)."""

    state: EngineState
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    num_running_completions: int = 0  # the sequences in the running batch (0 from a server without it)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Limits the server enforces."""

    max_model_len: int
    max_num_seqs: int
    max_waiting_requests: int
    max_concurrent_streams: int
    max_receive_message_bytes: int
    kv_block_size: int
    max_num_batched_tokens: int
    max_adapters: int = 0  # LoRA adapter slots (0: the server serves no adapters)
    max_lora_rank: int = 0


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """The running server."""

    server_version: str
    api_version: str
    uptime_seconds: float
    state: EngineState
    load: Load
    limits: ServerLimits
    adapters: tuple[str, ...] = ()  # the names of the LoRA adapters loaded now
