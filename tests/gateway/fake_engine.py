"""A scripted stand-in for AsyncEngine: the slice the vllm_compat servicer uses, no torch, no core process.

Completion `index` of a request generates tokens `1000 * index + 100, +101, ...` one per output, with `delay`
seconds of simulated compute between outputs, until max_tokens (LENGTH); max_tokens=None runs until aborted.
A prompt starting with FAIL_TOKEN fails with FinishReason.ERROR after its first token. `finish_reason` is
what ends a completion at max_tokens (LENGTH unless a test sets it). With `rejects_constraints`, a request
with a structured output fails with RequestError (naming its field) before its first output, as the engine
core refuses a constraint that does not compile after admission.

`push=True`: each request's outputs are produced on a task of their own and offered to the stream's sink
first, as AsyncEngine's output task offers them (frontend/request_state.py); what the sink declines reaches
the iterator, in order. `push=False`: the sink is never called (the servicer's pull path).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine_server.engine.model_info import ModelInfo
from engine_server.engine.types import EngineStats, FinishReason, RequestError, TokenLogprob
from engine_server.frontend.outputs import (
    CompletionChunk,
    EngineState,
    GenerateOutput,
    GenerateRequest,
    OutputSink,
)
from engine_server.frontend.tokenizer_pool import TokenizerPool
from fake_cache_events import FakeCacheCore

FAIL_TOKEN = 7
MAX_MODEL_LEN = 512
BLOCK_SIZE = 16


def expected_tokens(index: int, count: int) -> list[int]:
    return [1000 * index + 100 + i for i in range(count)]


@dataclass
class _Request:
    request: GenerateRequest
    finish: FinishReason | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    has_output: bool = False


class FakeTokenizer:
    max_token_bytes = 4  # one token per character

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Any:
        return SimpleNamespace(token_ids=self.encode_ids(text, add_special_tokens=add_special_tokens))

    def encode_ids(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) % 500 + 10 for c in text]
        return [1, *ids] if add_special_tokens else ids


class FakeOutputs:
    """One request's outputs as AsyncEngine's RequestStream hands them out, sink included."""

    def __init__(self, outputs: AsyncGenerator[GenerateOutput, None], *, push: bool) -> None:
        self._outputs = outputs
        self._sink: OutputSink | None = None
        self._ready: deque[GenerateOutput] = deque()  # produced, for the iterator
        self._changed = asyncio.Event()
        self._is_produced = False
        self._error: Exception | None = None  # what the request failed with (raised once the rest is read)
        self._producer = asyncio.get_running_loop().create_task(self._produce()) if push else None
        self.num_pushed = 0  # outputs the sink took

    def set_sink(self, sink: OutputSink | None) -> None:
        self._sink = sink

    def set_ready_callback(self, callback: object) -> bool:
        return False  # never calls back: the consumer iterates (a direct call takes its task at once)

    def close(self) -> None:
        if self._producer is not None and not self._producer.done():
            self._producer.cancel()

    def __aiter__(self) -> FakeOutputs:
        return self

    async def __anext__(self) -> GenerateOutput:
        if self._producer is None:
            return await anext(self._outputs)
        while not self._ready:
            if self._is_produced:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._changed.clear()
            await self._changed.wait()
        return self._ready.popleft()

    async def _produce(self) -> None:
        try:
            async for output in self._outputs:
                sink = self._sink
                # NOTE: as RequestState.wake: nothing is offered while a declined output waits for
                # the consumer
                if sink is not None and not self._ready and sink(output):
                    self.num_pushed += 1
                else:
                    self._ready.append(output)
                self._changed.set()
        except Exception as exc:  # NOTE: as RequestStream: the consumer gets the request's error
            self._error = exc
        finally:
            self._is_produced = True
            self._changed.set()

    async def aclose(self) -> None:
        producer = self._producer
        if producer is None:
            await self._outputs.aclose()
            return
        if not producer.done():  # NOTE: a finished stream closes without yielding, as RequestStream does
            producer.cancel()  # an unfinished request is cancelled inside `_run`, which records it
            await asyncio.wait([producer])


class FakeEngine:
    def __init__(self, tokenizer_dir: Path, *, delay: float = 0.0, push: bool = False) -> None:
        self.model_info = ModelInfo(
            model_path=str(tokenizer_dir), architecture="FakeForCausalLM", task="generate",
            max_model_len=MAX_MODEL_LEN, vocab_size=5000, bos_token_id=1, eos_token_ids=(2,),
            pad_token_id=None,
            dtype="float32", device="cpu", embedding_dim=4, num_parameters=0, num_kv_blocks=64,
            block_size=BLOCK_SIZE,
        )
        self.tokenizer = FakeTokenizer()
        self.tokenizer_pool = TokenizerPool()
        self.state = EngineState.SERVING
        self.delay = delay
        self.push = push
        self.finish_reason = FinishReason.LENGTH  # how a completion that reaches max_tokens ends
        self.rejects_constraints = False
        self.streams: list[FakeOutputs] = []
        self.requests: dict[str, _Request] = {}
        self.received: list[GenerateRequest] = []
        self.cancelled: list[str] = []  # requests whose consumer went away (closed the stream unfinished)
        self.flush_delay = 0.0
        self.num_flushes = 0
        self.cache_core = FakeCacheCore(block_size=BLOCK_SIZE)
        self.cache_events = self.cache_core.hub

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.requests.values() if r.has_output)

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self.requests.values() if not r.has_output)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=self.num_running, num_waiting=self.num_waiting, num_free_blocks=48,
                           num_total_blocks=64)

    def generate(self, request: GenerateRequest) -> FakeOutputs:
        if self.state is not EngineState.SERVING:
            from engine_server.engine.types import EngineDead

            raise EngineDead("not serving")
        if request.request_id in self.requests:
            raise RequestError("request_id", "duplicate")
        state = _Request(request)
        self.requests[request.request_id] = state
        self.received.append(request)
        stream = FakeOutputs(self._run(state), push=self.push)
        self.streams.append(stream)
        return stream

    async def _run(self, state: _Request) -> AsyncGenerator[GenerateOutput, None]:
        request = state.request
        params = request.params
        n = params.n
        num_tokens = 0
        try:
            constraint = request.structured_output
            if self.rejects_constraints and constraint is not None:
                await asyncio.sleep(0)
                state.finish = FinishReason.ERROR  # (refused, not cancelled)
                raise RequestError(constraint.field_name, "does not compile (simulated)")
            while True:
                if self.delay:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(state.wake.wait(), self.delay)
                else:
                    await asyncio.sleep(0)
                if state.finish is FinishReason.ABORT:
                    chunks = [CompletionChunk(i, [], "", None, FinishReason.ABORT, None, num_tokens)
                              for i in range(n)]
                    yield self._output(request, chunks, finished=True)
                    return
                num_tokens += 1
                state.has_output = True
                failed = request.prompt_token_ids[0] == FAIL_TOKEN
                is_last = params.max_tokens is not None and num_tokens >= params.max_tokens
                finish = FinishReason.ERROR if failed else self.finish_reason if is_last else None
                chunks = []
                for index in range(n):
                    token_id = expected_tokens(index, num_tokens)[-1]
                    logprobs = None
                    if params.logprobs is not None:
                        top = tuple((token_id + k, -0.5 * (k + 1)) for k in range(params.logprobs))
                        logprobs = [TokenLogprob(token_id, -0.5, 1, top)]
                    chunks.append(CompletionChunk(index, [token_id], "", logprobs, finish, None, num_tokens))
                prompt_logprobs = None
                if num_tokens == 1 and params.prompt_logprobs is not None:
                    prompt_logprobs = [None] + [TokenLogprob(t, -1.0, 1, ((t, -1.0),))
                                                for t in request.prompt_token_ids[1:]]
                output = self._output(request, chunks, finished=finish is not None,
                                      prompt_logprobs=prompt_logprobs)
                if failed:
                    output.error = "simulated engine failure"
                yield output
                if finish is not None:
                    return
        finally:
            if self.requests.pop(request.request_id, None) is not None and state.finish is None and (
                params.max_tokens is None or num_tokens < params.max_tokens
            ):
                self.cancelled.append(request.request_id)

    @staticmethod
    def _output(
        request: GenerateRequest, chunks: list[CompletionChunk], *, finished: bool,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> GenerateOutput:
        return GenerateOutput(request.request_id, chunks, len(request.prompt_token_ids), 3, prompt_logprobs,
                              finished)

    async def abort(self, request_ids: Sequence[str]) -> list[str]:
        aborted = []
        for request_id in request_ids:
            state = self.requests.get(request_id)
            if state is not None and state.finish is None:
                state.finish = FinishReason.ABORT
                state.wake.set()
                aborted.append(request_id)
        return aborted

    async def embed(self, inputs: list[list[int]], *, normalize: bool) -> list[list[float]]:
        return [[float(len(ids)), 0.0, 0.0, 1.0] for ids in inputs]

    async def flush_cache(self) -> int:
        """As the core does it: after `flush_delay` (the step in progress), the number of cached blocks."""
        self.num_flushes += 1
        await asyncio.sleep(self.flush_delay)
        return 7
