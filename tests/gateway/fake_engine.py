"""A scripted stand-in for AsyncEngine: the slice the vllm_compat servicer uses, no torch, no core process.

Completion `index` of a request generates tokens `1000 * index + 100, +101, ...` one per output, with `delay`
seconds of simulated compute between outputs, until max_tokens (LENGTH); max_tokens=None runs until aborted.
A prompt starting with FAIL_TOKEN fails with FinishReason.ERROR after its first token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine_server.engine.model_info import ModelInfo
from engine_server.engine.types import EngineStats, FinishReason, RequestError, TokenLogprob
from engine_server.frontend.outputs import CompletionChunk, EngineState, GenerateOutput, GenerateRequest

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
    def encode(self, text: str, *, add_special_tokens: bool = True) -> Any:
        ids = [ord(c) % 500 + 10 for c in text]
        return SimpleNamespace(token_ids=[1, *ids] if add_special_tokens else ids)


class FakeEngine:
    def __init__(self, tokenizer_dir: Path, *, delay: float = 0.0) -> None:
        self.model_info = ModelInfo(
            model_path=str(tokenizer_dir), architecture="FakeForCausalLM", task="generate",
            max_model_len=MAX_MODEL_LEN, vocab_size=5000, bos_token_id=1, eos_token_ids=(2,),
            pad_token_id=None,
            dtype="float32", device="cpu", embedding_dim=4, num_parameters=0, num_kv_blocks=64,
            block_size=BLOCK_SIZE,
        )
        self.tokenizer = FakeTokenizer()
        self.state = EngineState.SERVING
        self.delay = delay
        self.requests: dict[str, _Request] = {}
        self.received: list[GenerateRequest] = []
        self.cancelled: list[str] = []  # requests whose consumer went away (closed the stream unfinished)

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.requests.values() if r.has_output)

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self.requests.values() if not r.has_output)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=self.num_running, num_waiting=self.num_waiting, num_free_blocks=48,
                           num_total_blocks=64)

    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        if self.state is not EngineState.SERVING:
            from engine_server.engine.types import EngineDead

            raise EngineDead("not serving")
        if request.request_id in self.requests:
            raise RequestError("request_id", "duplicate")
        state = _Request(request)
        self.requests[request.request_id] = state
        self.received.append(request)
        return self._run(state)

    async def _run(self, state: _Request) -> AsyncGenerator[GenerateOutput, None]:
        request = state.request
        params = request.params
        n = params.n
        num_tokens = 0
        try:
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
                finish = FinishReason.ERROR if failed else FinishReason.LENGTH if is_last else None
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
