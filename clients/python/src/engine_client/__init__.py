"""engine-client: typed Python client (asyncio and sync) for the engine.v1 gRPC inference API.

Example::

    from engine_client import EngineClient

    with EngineClient("127.0.0.1:50051") as client:
        result = client.complete("Hello", max_tokens=16, temperature=0.0)
        print(result.text, result.finish_reason, result.usage)
"""

from __future__ import annotations

from .adapters import AdapterInfo
from .aio import AsyncEngineClient, AsyncGenerateStream
from .cache_events import (
    CacheBlocksRemoved,
    CacheBlocksStored,
    CacheCleared,
    CacheEvent,
    CacheEventBatch,
    SnapshotPart,
)
from .errors import (
    AuthenticationError,
    DeadlineExceededError,
    EngineError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    RequestCancelledError,
    StatusCode,
    UnavailableError,
    UnimplementedError,
)
from .options import DEFAULT_TARGET, ConnectionOptions, RetryPolicy, TLSConfig
from .params import GenerateOptions, GenerateParams
from .structured import Choice, Grammar, JsonObject, JsonSchema, Regex, StructuralTag, StructuredOutput, Tag
from .sync import EngineClient, GenerateStream
from .types import (
    Completion,
    Embedding,
    EmbedResult,
    EngineState,
    FinishReason,
    GenerateChunk,
    GenerateResult,
    HealthStatus,
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

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TARGET",
    "AdapterInfo",
    "AsyncEngineClient",
    "AsyncGenerateStream",
    "AuthenticationError",
    "CacheBlocksRemoved",
    "CacheBlocksStored",
    "CacheCleared",
    "CacheEvent",
    "CacheEventBatch",
    "Choice",
    "Completion",
    "ConnectionOptions",
    "DeadlineExceededError",
    "EmbedResult",
    "Embedding",
    "EngineClient",
    "EngineError",
    "EngineState",
    "FinishReason",
    "GenerateChunk",
    "GenerateOptions",
    "GenerateParams",
    "GenerateResult",
    "GenerateStream",
    "Grammar",
    "HealthStatus",
    "InternalError",
    "InvalidRequestError",
    "JsonObject",
    "JsonSchema",
    "Load",
    "ModelInfo",
    "ModelTask",
    "NotFoundError",
    "OverloadedError",
    "PermissionDeniedError",
    "Regex",
    "RequestCancelledError",
    "RetryPolicy",
    "ServerInfo",
    "ServerLimits",
    "SnapshotPart",
    "StatusCode",
    "StructuralTag",
    "StructuredOutput",
    "TLSConfig",
    "Tag",
    "TokenLogprob",
    "TokenizeResult",
    "TopLogprob",
    "UnavailableError",
    "UnimplementedError",
    "Usage",
    "__version__",
]
