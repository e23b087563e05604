"""A simulated engine core for frontend benchmarks: no model, fixed step time, one token per sequence a step.

It speaks the same `EngineCore` protocol as `LLMEngine` and runs behind the same process boundary, so a
benchmark on it measures the frontend (IPC, detokenizer, API layer, transport) and nothing else. It reads the
model directory's config.json only for the vocabulary and the special tokens; the tokenizer is the real one.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine_server.engine.types import (
    CompletionDelta,
    EngineOverloaded,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestError,
)

if TYPE_CHECKING:
    from engine_server.engine.config import EngineConfig
    from engine_server.engine.model_info import ModelInfo

_FIRST_ORDINARY_ID = 16  # below: special tokens in the embedded tiny model (bos, eos, pad, chat markers)


@dataclass(slots=True)
class _SimSeq:
    request_id: str
    index: int
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int = 0


class SimulatedEngine:
    """`step()` sleeps `step_s` and then emits one token for every running sequence (admitted FIFO)."""

    def __init__(self, config: EngineConfig, *, step_s: float) -> None:
        if step_s < 0:
            raise ValueError(f"step_s: must be >= 0, got {step_s}")
        from engine_server.engine.loader import read_json
        from engine_server.engine.model_info import ModelInfo

        model_dir = Path(config.model)
        hf = read_json(model_dir / "config.json")
        if not hf:
            raise FileNotFoundError(f"model directory {str(model_dir)!r} has no config.json")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        max_model_len = config.max_model_len or int(hf.get("max_position_embeddings", 2048))
        self.model_info: ModelInfo = ModelInfo(
            model_path=str(model_dir), architecture="SimulatedEngine", task="generate",
            max_model_len=max_model_len, vocab_size=int(hf["vocab_size"]),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids, pad_token_id=hf.get("pad_token_id"), dtype="none", device="cpu",
            embedding_dim=None, num_parameters=0, num_kv_blocks=1 << 20, block_size=config.block_size,
        )
        self._step_s = step_s
        self._max_num_seqs = config.max_num_seqs
        self._max_waiting = config.max_waiting
        self._num_ids = self.model_info.vocab_size - _FIRST_ORDINARY_ID
        self._waiting: deque[EngineRequest] = deque()
        self._running: dict[tuple[str, int], _SimSeq] = {}
        self._pending_aborts: list[str] = []
        self._pending_completion_aborts: list[tuple[str, int]] = []

    def add_request(self, request: EngineRequest) -> None:
        if len(self._waiting) >= self._max_waiting:
            raise EngineOverloaded(f"the waiting queue is full ({self._max_waiting} requests)")
        if not request.prompt_token_ids:
            raise RequestError("prompt", "must not be empty")
        if request.structured_output is not None:
            raise RequestError("structured_output", "the simulated engine does not constrain its output")
        self._waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        known = {seq.request_id for seq in self._running.values()} | {r.request_id for r in self._waiting}
        found = [rid for rid in request_ids if rid in known]
        self._pending_aborts.extend(found)
        return found

    def abort_completions(self, completions: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        """Single running completions (a stop string ended one of n): each ends with ABORT next step."""
        found = [key for key in completions if key in self._running]
        self._pending_completion_aborts.extend(found)
        return found

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def stats(self) -> EngineStats:
        num_running = len({request_id for request_id, _ in self._running})  # requests, as LLMEngine counts
        return EngineStats(num_running=num_running, num_waiting=len(self._waiting),
                           num_free_blocks=self.model_info.num_kv_blocks,
                           num_total_blocks=self.model_info.num_kv_blocks,
                           num_running_completions=len(self._running))

    def embed(self, inputs: list[list[int]], *, normalize: bool) -> list[list[float]]:
        raise RequestError("model", "the simulated engine does not embed")

    def flush_cache(self) -> int:
        return 0  # it keeps no KV cache

    def pop_rejected(self) -> list[tuple[str, RequestError]]:
        return []  # it refuses constraints at admission (add_request)

    def step(self) -> list[CompletionDelta]:
        deltas = self._process_aborts()
        # 1) Admit FIFO while there is room; a new sequence emits its first token in this very step.
        while self._waiting and len(self._running) < self._max_num_seqs:
            request = self._waiting.popleft()
            params = request.params
            max_tokens = params.max_tokens or self.model_info.max_model_len - len(request.prompt_token_ids)
            for index in range(params.n):
                self._running[(request.request_id, index)] = _SimSeq(
                    request.request_id, index, len(request.prompt_token_ids), max(1, max_tokens))
        if not self._running:
            return deltas
        # 2) The "forward pass".
        if self._step_s:
            time.sleep(self._step_s)
        # 3) One token each; deterministic ordinary (non-special) ids so detokenizing them is realistic.
        finished = []
        num_ids, first = self._num_ids, _FIRST_ORDINARY_ID
        for key, seq in self._running.items():
            seq.num_output_tokens += 1
            num_out = seq.num_output_tokens
            token_id = first + (num_out * 7919 + seq.index) % num_ids
            delta = CompletionDelta(seq.request_id, seq.index, [token_id])
            if num_out == 1 and seq.index == 0:
                delta.num_prompt_tokens = seq.num_prompt_tokens
            if num_out >= seq.max_tokens:
                delta.finish_reason = FinishReason.LENGTH
                finished.append(key)
            deltas.append(delta)
        for key in finished:
            del self._running[key]
        return deltas

    def _process_aborts(self) -> list[CompletionDelta]:
        deltas: list[CompletionDelta] = []
        for key in self._pending_completion_aborts:
            if self._running.pop(key, None) is not None:
                deltas.append(CompletionDelta(key[0], key[1], [], finish_reason=FinishReason.ABORT))
        self._pending_completion_aborts.clear()
        if not self._pending_aborts:
            return deltas
        aborted = set(self._pending_aborts)
        self._pending_aborts.clear()
        for request in [r for r in self._waiting if r.request_id in aborted]:
            self._waiting.remove(request)
            deltas.extend(CompletionDelta(request.request_id, index, [], finish_reason=FinishReason.ABORT)
                          for index in range(request.params.n))
        for key in [key for key in self._running if key[0] in aborted]:
            del self._running[key]
            deltas.append(CompletionDelta(key[0], key[1], [], finish_reason=FinishReason.ABORT))
        return deltas


def _make_simulated(config: EngineConfig, *, step_s: float) -> SimulatedEngine:
    return SimulatedEngine(config, step_s=step_s)


def simulated_engine_factory(step_ms: float) -> Callable[[EngineConfig], SimulatedEngine]:
    """An `EngineFactory` (picklable, for the spawned core process) for `AsyncEngine.start`."""
    return functools.partial(_make_simulated, step_s=step_ms / 1000.0)
