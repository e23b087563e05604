"""A deterministic stand-in for LLMEngine with the same interface, for testing the process boundary.

Each completion echoes its prompt token by token (cycling), so a test controls the generated text by
choosing the prompt. Blocks are accounted like a paged cache (ceil(tokens / block_size) per sequence).
Failure injection: a request whose id starts with "crash" makes the next step() raise. A request whose id
starts with "boom" makes add_request raise a RuntimeError (a core bug hit by one request). One whose id
starts with "fail" ends with FinishReason.ERROR at its first step (the core lives on). One whose id
starts with "hold" never finishes on its own: after max_tokens it stays running, silent, until aborted.
One whose id starts with "gate" (n > 1; after the shared core's "i/" prefix too) runs its completion 0
alone, holding like "hold", until that completion is aborted (`abort_completions`); then completion i
echoes the prompt rotated by i tokens.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine_server.engine.config import EngineConfig
from engine_server.engine.model_info import ModelInfo
from engine_server.engine.types import (
    CompletionDelta,
    EngineOverloaded,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestError,
)

NUM_BLOCKS = 64
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
EOS_ID = 1


@dataclass(slots=True)
class _Seq:
    request: EngineRequest
    index: int
    output: list[int] = field(default_factory=list)
    num_blocks: int = 0
    is_first: bool = True


def _is_gate(request_id: str) -> bool:
    return request_id.rpartition("/")[2].startswith("gate")


def fake_validate(request: EngineRequest, info: ModelInfo) -> None:
    if not request.prompt_token_ids:
        raise RequestError("prompt_token_ids", "must not be empty")
    for position, token_id in enumerate(request.prompt_token_ids):
        if not 0 <= token_id < info.vocab_size:
            raise RequestError(f"prompt_token_ids[{position}]", f"{token_id} is outside the vocabulary")


class FakeCore:
    def __init__(self, config: EngineConfig, *, vocab_size: int, step_delay: float = 0.0) -> None:
        self.model_info = ModelInfo(
            model_path=config.model, architecture="FakeForCausalLM", task="generate",
            max_model_len=MAX_MODEL_LEN, vocab_size=vocab_size, bos_token_id=0, eos_token_ids=(EOS_ID,),
            pad_token_id=2, dtype="float32", device="cpu", embedding_dim=4, num_parameters=0,
            num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
        )
        self._config = config
        self._step_delay = step_delay
        self._running: list[_Seq] = []
        self._waiting: list[_Seq] = []
        self._aborted: list[_Seq] = []
        self._remaining: dict[str, int] = {}  # request id -> unfinished sequences
        self._free_blocks = NUM_BLOCKS
        self._crash = False
        self.aborted_completions: list[tuple[str, int]] = []  # what abort_completions found, in order

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._remaining:
            raise RequestError("request_id", "duplicate")
        if len(self._waiting) >= self._config.max_waiting:
            raise EngineOverloaded("waiting queue full")
        fake_validate(request, self.model_info)
        if request.request_id.startswith("boom"):
            raise RuntimeError("injected add_request bug")
        if request.request_id.startswith("crash"):
            self._crash = True
        self._remaining[request.request_id] = request.params.n
        self._waiting.extend(_Seq(request, index) for index in range(request.params.n))

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        wanted = set(request_ids) & self._remaining.keys()
        for queue in (self._running, self._waiting):
            self._aborted.extend(seq for seq in queue if seq.request.request_id in wanted)
            queue[:] = [seq for seq in queue if seq.request.request_id not in wanted]
        return sorted(wanted)

    def abort_completions(self, completions: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        wanted = set(completions)
        found: list[tuple[str, int]] = []
        for queue in (self._running, self._waiting):
            hit = [seq for seq in queue if (seq.request.request_id, seq.index) in wanted]
            self._aborted.extend(hit)
            found.extend((seq.request.request_id, seq.index) for seq in hit)
            queue[:] = [seq for seq in queue if (seq.request.request_id, seq.index) not in wanted]
        self.aborted_completions.extend(found)
        return found

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting or self._aborted)

    def pop_rejected(self) -> list[tuple[str, RequestError]]:
        return []

    def step(self) -> list[CompletionDelta]:
        if self._crash:
            raise RuntimeError("injected engine failure")
        if self._step_delay:
            time.sleep(self._step_delay)  # simulated compute, not synchronisation
        deltas = [self._finish(seq, FinishReason.ABORT, None) for seq in self._aborted]
        self._aborted.clear()
        while self._waiting and len(self._running) < self._config.max_num_seqs:
            self._running.append(self._waiting.pop(0))
        still_running = []
        gated = {seq.request.request_id for seq in self._running
                 if seq.index == 0 and _is_gate(seq.request.request_id)}
        for seq in self._running:
            request = seq.request
            prompt = request.prompt_token_ids
            params = request.params
            if request.request_id in gated and seq.index > 0:  # until completion 0 is aborted
                still_running.append(seq)
                continue
            holds = request.request_id.startswith("hold") or request.request_id in gated
            if holds and len(seq.output) >= (params.max_tokens or 1):
                still_running.append(seq)
                continue
            if request.request_id.startswith("fail"):
                failed = self._finish(seq, FinishReason.ERROR, None)
                failed.error = "injected request failure"
                deltas.append(failed)
                continue
            rotation = seq.index if _is_gate(request.request_id) else 0
            token_id = prompt[(len(seq.output) + rotation) % len(prompt)]
            seq.output.append(token_id)
            needed = math.ceil((len(prompt) + len(seq.output)) / BLOCK_SIZE)
            self._free_blocks -= needed - seq.num_blocks
            seq.num_blocks = needed
            delta = CompletionDelta(request.request_id, seq.index, [token_id])
            if seq.is_first and seq.index == 0:
                delta.num_prompt_tokens = len(prompt)
            seq.is_first = False
            stops = (*params.stop_token_ids, *(() if params.ignore_eos else (EOS_ID,)))
            if token_id in stops and len(seq.output) >= params.min_tokens:
                self._release(seq)
                delta.finish_reason, delta.stop_token_id = FinishReason.STOP, token_id
            elif len(seq.output) >= (params.max_tokens or MAX_MODEL_LEN - len(prompt)) and not holds:
                self._release(seq)
                delta.finish_reason = FinishReason.LENGTH
            else:
                still_running.append(seq)
            deltas.append(delta)
        self._running = still_running
        return deltas

    def _finish(self, seq: _Seq, reason: FinishReason, stop_token_id: int | None) -> CompletionDelta:
        self._release(seq)
        return CompletionDelta(seq.request.request_id, seq.index, [], finish_reason=reason,
                               stop_token_id=stop_token_id)

    def _release(self, seq: _Seq) -> None:
        self._free_blocks += seq.num_blocks
        seq.num_blocks = 0
        request_id = seq.request.request_id
        self._remaining[request_id] -= 1
        if not self._remaining[request_id]:
            del self._remaining[request_id]

    def stats(self) -> EngineStats:
        return EngineStats(len({s.request.request_id for s in self._running}),
                           len({s.request.request_id for s in self._waiting}),
                           self._free_blocks, NUM_BLOCKS)

    def embed(self, inputs: list[list[int]], *, normalize: bool) -> list[list[float]]:
        if any(not ids for ids in inputs):
            raise RequestError("inputs", "must not be empty")
        vectors = [[float(len(ids)), float(sum(ids)), 1.0, 0.0] for ids in inputs]
        if normalize:
            vectors = [[x / math.sqrt(sum(v * v for v in vec)) for x in vec] for vec in vectors]
        return vectors

    def flush_cache(self) -> int:
        """No prefix cache here: nothing to drop."""
        return 0


def fake_config(model_dir: object, *, max_num_seqs: int = 8, max_waiting: int = 16) -> EngineConfig:
    return EngineConfig(model=str(model_dir), max_num_seqs=max_num_seqs, max_waiting=max_waiting)


def make_fake_core(config: EngineConfig, *, vocab_size: int, step_delay: float = 0.0) -> FakeCore:
    return FakeCore(config, vocab_size=vocab_size, step_delay=step_delay)


def fake_factory(vocab_size: int, *, step_delay: float = 0.0) -> functools.partial[FakeCore]:
    """A picklable factory (works across the spawn boundary)."""
    return functools.partial(make_fake_core, vocab_size=vocab_size, step_delay=step_delay)
