"""A small fake of the AsyncEngine handle (the `EngineHandle` protocol) for fast in-process server tests.

Each completion generates `prompt[-1] + 1, + 2, ...` (mod vocab), one token per step, until max_tokens
(default 4). `gate` pauses every stream after its first output, so tests can hold requests in flight.
`fail_with` makes generate() raise; `error_text` makes the first output carry an engine error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine_server.engine.model_info import ModelInfo
from engine_server.engine.types import EngineDead, EngineStats, FinishReason
from engine_server.frontend.outputs import CompletionChunk, EngineState, GenerateOutput, GenerateRequest
from engine_server.frontend.tokenizer_pool import TokenizerPool
from fake_cache_events import FakeCacheCore

VOCAB = 128
BOS = 0
EOS = 1
MAX_LEN = 64


@dataclass(frozen=True)
class FakeEncoding:
    token_ids: list[int]
    offsets: list[tuple[int, int]]


class FakeTokenizer:
    """One token per character (code point % VOCAB), BOS = 0."""

    has_chat_template = True
    max_token_bytes = 4  # one token per character

    def encode(self, text: str, *, add_special_tokens: bool = True) -> FakeEncoding:
        ids = [2 + ord(ch) % (VOCAB - 2) for ch in text]
        offsets = [(i, i + 1) for i in range(len(text))]
        if add_special_tokens:
            return FakeEncoding([BOS, *ids], [(0, 0), *offsets])
        return FakeEncoding(ids, offsets)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(chr(96 + t % 26) for t in token_ids if not (skip_special_tokens and t in (BOS, EOS)))

    def encode_ids(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.encode(text, add_special_tokens=add_special_tokens).token_ids

    def render_chat(self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True) -> str:
        text = "".join(f"{role}:{content};" for role, content in messages)
        return text + ("assistant:" if add_generation_prompt else "")


class FakeStream:
    def __init__(self, engine: FakeEngine, request: GenerateRequest) -> None:
        self._engine = engine
        self._request = request
        self._step = 0
        self._is_done = False
        self._aborted = asyncio.Event()

    def __aiter__(self) -> FakeStream:
        return self

    def set_sink(self, sink: object, plain_sink: object = None) -> None:
        """Never pushes: the servicer's pull path (every output through the iterator) stays covered."""

    def set_ready_callback(self, callback: object) -> bool:
        return False  # never calls back: the consumer must iterate (the call keeps its task)

    async def __anext__(self) -> GenerateOutput:
        if self._is_done:
            raise StopAsyncIteration
        engine, request = self._engine, self._request
        if self._step > 0 and not engine.gate.is_set():
            waiter = asyncio.ensure_future(engine.gate.wait())
            aborter = asyncio.ensure_future(self._aborted.wait())
            try:
                await asyncio.wait({waiter, aborter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                aborter.cancel()
        await asyncio.sleep(0)
        self._step += 1
        max_tokens = request.params.max_tokens or 4
        if self._aborted.is_set():
            reason: FinishReason | None = FinishReason.ABORT
            token_ids: list[int] = []
        else:
            reason = FinishReason.LENGTH if self._step >= max_tokens else None
            token_ids = [(request.prompt_token_ids[-1] + self._step) % VOCAB]
        chunks = [
            CompletionChunk(
                index,
                list(token_ids),
                self._engine.tokenizer.decode(token_ids),
                None,
                reason,
                None,
                self._step if token_ids else self._step - 1,
            )
            for index in range(request.params.n)
        ]
        error = engine.error_text if self._step == 1 else None
        self._is_done = reason is not None or error is not None
        if self._is_done:
            engine.finished(request.request_id)
        return GenerateOutput(
            request.request_id, chunks, len(request.prompt_token_ids), 0, None, reason is not None, error
        )

    def abort(self) -> None:
        self._aborted.set()

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if not self._is_done:
            self._is_done = True
            self._engine.num_cancelled += 1
            self._engine.finished(self._request.request_id)


class FakeEngine:
    def __init__(self) -> None:
        self.model_info = ModelInfo(
            model_path="/fake/model",
            architecture="FakeForCausalLM",
            task="generate",
            max_model_len=MAX_LEN,
            vocab_size=VOCAB,
            bos_token_id=BOS,
            eos_token_ids=(EOS,),
            pad_token_id=None,
            dtype="float32",
            device="cpu",
            embedding_dim=None,
            num_parameters=1,
            num_kv_blocks=32,
            block_size=16,
        )
        self.tokenizer = FakeTokenizer()
        self.tokenizer_pool = TokenizerPool()
        self.state = EngineState.SERVING
        self.core_pid: int | None = None  # no core process: in this one
        self.cache_core = FakeCacheCore()
        self.cache_events = self.cache_core.hub
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_with: Exception | None = None
        self.error_text: str | None = None
        self.in_flight: dict[str, FakeStream] = {}
        self.num_cancelled = 0
        self.requests: list[GenerateRequest] = []
        self._idle = asyncio.Event()
        self._idle.set()

    def finished(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        if not self.in_flight:
            self._idle.set()

    def add_state_listener(self, listener: Callable[[EngineState], None]) -> None:
        """(The fake's state is set directly; the server also polls it.)"""

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.in_flight), num_waiting=0, num_free_blocks=32, num_total_blocks=32
        )

    def generate(self, request: GenerateRequest) -> FakeStream:
        if self.state is not EngineState.SERVING:
            raise EngineDead(f"the engine is {self.state.value}")
        if self.fail_with is not None:
            raise self.fail_with
        self.requests.append(request)
        stream = FakeStream(self, request)
        self.in_flight[request.request_id] = stream
        self._idle.clear()
        return stream

    async def abort(self, request_ids: Sequence[str]) -> list[str]:
        aborted = [rid for rid in request_ids if rid in self.in_flight]
        for rid in aborted:
            self.in_flight[rid].abort()
        return aborted

    async def embed(self, inputs: list[list[int]], *, normalize: bool) -> list[list[float]]:
        return [[float(len(ids)), 0.0] for ids in inputs]

    async def flush_cache(self) -> int:
        return 0  # it caches nothing

    def begin_drain(self) -> None:
        if self.state is EngineState.SERVING:
            self.state = EngineState.DRAINING

    async def shutdown(self, *, timeout: float) -> None:  # noqa: ASYNC109 - the handle's signature
        self.begin_drain()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            await self.abort(list(self.in_flight))
        self.state = EngineState.STOPPED
