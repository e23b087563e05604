"""The engine core's loop: admit requests, step the scheduler and the model, emit deltas.

Single-threaded by design: the frontend calls add_request / abort / step from one thread
(the engine's own process or thread), never from a coroutine.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_server.engine.block_manager import BlockManager, cache_root
from engine_server.engine.config import EngineConfig
from engine_server.engine.loader import LoadedModel, load_model
from engine_server.engine.lora.errors import AdapterError, AdapterNotFound, AdapterSlotsFull
from engine_server.engine.lora.manager import LoraManager
from engine_server.engine.lora.types import AdapterInfo
from engine_server.engine.model_info import ModelInfo
from engine_server.engine.model_runner import ModelRunner, StepLogits
from engine_server.engine.sampler import Sampler, logprobs_of
from engine_server.engine.scheduler import ScheduledSeq, Scheduler
from engine_server.engine.sequence import Sequence, SequenceStatus
from engine_server.engine.types import (
    CompletionDelta,
    EngineOverloaded,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestError,
    TokenLogprob,
)

if TYPE_CHECKING:
    from engine_server.engine.structured.compiler import CompileJob, GrammarCompiler
    from engine_server.engine.structured.masks import AllowedTokens, MaskFill, MaskFiller

logger = logging.getLogger(__name__)

_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads per-index seeds of an n>1 request apart


def index_seed(seed: int, index: int) -> int:
    """Completion `index` of a seeded request uses this seed (index 0 uses the request's own)."""
    return (seed + index * _SEED_STRIDE) % 2**64


@dataclass(slots=True)
class _RequestState:
    request: EngineRequest
    seqs: dict[int, Sequence] = field(default_factory=dict)  # live completions by index
    finished_indices: set[int] = field(default_factory=set)
    compile_job: CompileJob | None = None  # its constraint is compiling; index 0 waits outside the scheduler



def _assert_memory_safe(request: EngineRequest, info: ModelInfo) -> None:
    """What add_request checks of a request again: only what guards memory, for a caller that skipped the
    frontend's validation (a test, a tool). Asserts, not errors: the frontend refuses such a request first.

    NOTE: a token id outside [0, vocab) indexes past the embedding table and, through logit_bias and
    min_tokens' stop-token masking, past the logits row (on CUDA a device-side assert that leaves the context
    unusable); a prompt of max_model_len tokens or more puts positions past the rotary tables and past the
    block tables the attention kernels read without bounds checks.
    """
    prompt = request.prompt_token_ids
    assert 0 < len(prompt) < info.max_model_len, "the prompt's length is checked at admission"
    params = request.params
    for token_ids in (prompt, params.stop_token_ids, tuple(token_id for token_id, _ in params.logit_bias)):
        assert not token_ids or (min(token_ids) >= 0 and max(token_ids) < info.vocab_size), (
            "token ids are checked at admission")

class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        loaded: LoadedModel = load_model(config)
        self.model_info: ModelInfo = loaded.info
        self._loaded = loaded
        self._requests: dict[str, _RequestState] = {}
        self._pending_aborts: list[str] = []
        self._pending_completion_aborts: list[tuple[str, int]] = []  # (request_id, index)
        self._seq_ids = itertools.count()
        self.block_manager = BlockManager(loaded.info.num_kv_blocks, loaded.info.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self.runner: ModelRunner | None = None
        if loaded.info.task == "generate" and loaded.kv is not None:
            self.runner = ModelRunner(loaded.model, kv=loaded.kv, num_blocks=loaded.info.num_kv_blocks,
                                      block_size=loaded.info.block_size, dtype=loaded.dtype,
                                      device=loaded.device, max_num_seqs=config.max_num_seqs,
                                      max_model_len=loaded.info.max_model_len)
            self.runner.check_model()
        # LoRA: the hook goes on the linears' forwards as packed by the runner (engine/lora/apply.py)
        self._lora: LoraManager | None = None
        if config.max_adapters and self.runner is not None:
            self._lora = LoraManager(loaded.model, max_adapters=config.max_adapters,
                                     max_rank=config.max_lora_rank, dtype=loaded.dtype, device=loaded.device)
            self.runner.lora = self._lora
            for name, path in config.adapters:
                self._lora.load(name, path)
        self.sampler = Sampler(vocab_size=loaded.info.vocab_size, eos_token_ids=loaded.info.eos_token_ids)
        # Structured output: the compiler starts now (its tokenizer builds in the background), so the first
        # constrained request costs the step loop no import and no tokenizer build.
        self._grammar_compiler: GrammarCompiler | None = None
        if self.runner is not None:
            self._compiler()
        self._mask_filler: MaskFiller | None = None
        # The next step's masks, started as a step ends (its constrained completions go on): they fill while
        # the step's outputs go out and the next one is scheduled, not only beside its forward pass
        self._next_masks: MaskFill | None = None
        self._compiling: dict[str, _RequestState] = {}  # request_id -> state, oldest first
        self._rejected: list[tuple[str, RequestError]] = []  # refused after admission (their constraint)
        info = loaded.info
        logger.info("loaded %s (%s, %s, %d parameters) on %s as %s; max_model_len %d, "
                    "%d KV blocks of %d tokens", info.model_path, info.architecture, info.task,
                    info.num_parameters, info.device, info.dtype, info.max_model_len, info.num_kv_blocks,
                    info.block_size)

    # 1) admission
    def add_request(self, request: EngineRequest) -> None:
        """Admits a request that the frontend has validated (frontend/validation.py: once, at admission).

        Raises RequestError for a request id in use and EngineOverloaded when the waiting queue is full: the
        engine's own state, which only it knows.
        """
        _assert_memory_safe(request, self.model_info)
        params = request.params
        if request.request_id in self._requests:
            raise RequestError("request_id", f"{request.request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} requests are waiting; retry later")
        num_prompt = len(request.prompt_token_ids)
        max_tokens = self.model_info.max_model_len - num_prompt
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        lora_slot = self._pin_adapter(request)  # NOTE: the last check that may refuse: nothing to undo after
        seq = self._new_sequence(request, 0, list(request.prompt_token_ids), max_tokens)
        seq.num_siblings_to_fork = params.n - 1
        seq.lora_slot = lora_slot
        state = _RequestState(request, {0: seq})
        self._requests[request.request_id] = state
        if request.structured_output is None:
            self.scheduler.add(seq)
            return
        # NOTE: the request waits for its grammar outside the scheduler; the batch goes on meanwhile
        seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
        state.compile_job = self._compiler().submit(request.structured_output)
        self._compiling[request.request_id] = state

    def _compiler(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            from engine_server.engine.structured.compiler import GrammarCompiler

            info, config = self.model_info, self.config
            self._grammar_compiler = GrammarCompiler(
                model_path=info.model_path, vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids,
                num_threads=config.grammar_compile_threads, timeout_s=config.grammar_compile_timeout_s,
                cache_size=config.grammar_cache_size)
        return self._grammar_compiler

    def _admit_compiled(self) -> None:
        """Requests whose constraint compiled join the scheduler; the failed ones are refused."""
        now = time.monotonic()
        for request_id, state in list(self._compiling.items()):
            assert state.compile_job is not None
            outcome = state.compile_job.poll(now)
            if outcome is None:
                continue
            del self._compiling[request_id]
            state.compile_job = None
            seq = state.seqs[0]
            if isinstance(outcome, RequestError):
                del self._requests[request_id]
                self._unpin_adapter(state.request)
                seq.status = SequenceStatus.FINISHED
                self._rejected.append((request_id, outcome))
            else:
                seq.matcher = outcome
                self.scheduler.add(seq)

    def pop_rejected(self) -> list[tuple[str, RequestError]]:
        """Requests refused after add_request accepted them (their constraint did not compile), once each."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def _new_sequence(self, request: EngineRequest, index: int, token_ids: list[int],
                      max_tokens: int) -> Sequence:
        generator = None
        if request.params.seed is not None:
            generator = torch.Generator(device=self._loaded.device)
            generator.manual_seed(index_seed(request.params.seed, index))
        seq_id = next(self._seq_ids)
        return Sequence(seq_id=seq_id, request_id=request.request_id, index=index,
                        params=request.params, token_ids=token_ids,
                        num_prompt_tokens=len(request.prompt_token_ids), max_tokens=max_tokens,
                        generator=generator, priority=request.priority, arrival=seq_id,
                        cache_root=self._cache_root(request), cache_salt=request.cache_salt)

    def _cache_root(self, request: EngineRequest) -> int:
        if request.adapter and self._lora is not None:  # (a pinned adapter: loaded)
            return self._lora.cache_root(request.adapter, request.cache_salt)
        return cache_root(request.cache_salt)

    # LoRA adapters (engine/lora/): a request pins its adapter's slot from admission to its end
    def _pin_adapter(self, request: EngineRequest) -> int:
        if not request.adapter:
            return -1
        if self._lora is None:
            raise RequestError("adapter", "this server serves no LoRA adapters")
        try:
            return self._lora.pin(request.adapter)
        except AdapterNotFound as e:
            raise RequestError("adapter", str(e)) from e
        except AdapterSlotsFull as e:
            raise EngineOverloaded(str(e)) from e

    def _unpin_adapter(self, request: EngineRequest) -> None:
        if request.adapter and self._lora is not None:
            self._lora.unpin(request.adapter)

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Loads a PEFT LoRA adapter (engine/lora/loader.py); an AdapterError where it is refused, with
        nothing loaded. Run-time loads read only inside config.adapter_dir (paths resolved, symlinks too)."""
        if self._lora is None:
            raise AdapterError("this server serves no LoRA adapters (max_adapters is 0)")
        if self.config.adapter_dir is None:
            raise AdapterError("loading adapters at run time is off (no adapter directory configured)")
        return self._lora.load(name, path, allowed_root=self.config.adapter_dir)

    def unload_adapter(self, name: str) -> None:
        """Forgets an adapter; AdapterInUse while requests using it run or wait (they are not cut short)."""
        if self._lora is None:
            raise AdapterNotFound(f"no adapter named {name!r} is loaded")
        self._lora.unload(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self._lora.infos() if self._lora is not None else []

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        found = [rid for rid in request_ids if rid in self._requests and rid not in self._pending_aborts]
        self._pending_aborts.extend(found)
        return found

    def abort_completions(self, completions: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        """Aborts single completions (request_id, index) of n > 1 requests; their siblings go on.

        Each ends with an ABORT delta at the next step, which frees its own blocks. Returns the ones
        that were live.
        """
        found = []
        for request_id, index in completions:
            state = self._requests.get(request_id)
            if state is None or not 0 <= index < state.request.params.n or index in state.finished_indices:
                continue
            seq = state.seqs.get(index)
            is_pending = seq is not None and seq.is_abort_pending
            if is_pending or (request_id, index) in self._pending_completion_aborts:
                continue  # already being aborted
            found.append((request_id, index))
            self._pending_completion_aborts.append((request_id, index))
        return found

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        running = self.scheduler.running
        num_running = len({seq.request_id for seq in running})  # (n > 1: one request, several sequences)
        return EngineStats(
            # NOTE: every other request is waiting: queued, preempted, or for its grammar (its constraint
            # compiles), not for room
            num_running=num_running,
            num_waiting=len(self._requests) - num_running,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_cache_hit_tokens=self.scheduler.num_prefix_cache_hit_tokens,
            num_running_completions=len(running),
        )

    def flush_cache(self) -> int:
        """Empties the prefix cache between two steps; nothing is preempted (block_manager.flush)."""
        return self.block_manager.flush()

    def embed(self, inputs: list[list[int]], *, normalize: bool) -> list[list[float]]:
        if self._loaded.embedder is None:
            raise RequestError("model", f"{self.model_info.model_path!r} is not an embedding model")
        vectors: list[list[float]] = self._loaded.embedder.embed(inputs, normalize=normalize)
        return vectors

    # 2) the step
    def step(self) -> list[CompletionDelta]:
        """One scheduler step; at most one delta per completion (ABORT deltas of aborted ones first)."""
        # 1) aborts free their blocks before anything is scheduled
        deltas = self._process_aborts()
        if self.runner is None:
            return deltas
        if self._compiling:
            self._admit_compiled()
        # 2) schedule and run one flattened forward pass (constrained rows' masks fill meanwhile)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self._compiling:  # nothing else to do: wait a little for a grammar rather than spin
                next(iter(self._compiling.values())).compile_job.wait(0.005)  # type: ignore[union-attr]
            return deltas
        masks = self._start_masks(sched.scheduled)
        step_logits, ordered = self.runner.execute(sched.scheduled)
        if masks is not None:
            # NOTE: before anything touches a matcher again (a fork copies its parent's)
            self._finish_masks(masks)
        # 3) the KV of the scheduled tokens now exists: count it, publish full blocks to the prefix cache
        for s in ordered:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.register_full_blocks(s.seq)
        self._collect_prompt_logprobs(step_logits, ordered)
        # 4) sample for every sequence whose last token was computed (forking n > 1 siblings), emit
        sample_seqs, rows, mask_keys = self._sampling_rows(step_logits, ordered)
        if sample_seqs:
            logits = step_logits.logits
            if rows != list(range(logits.shape[0])):  # prompt-logprob rows to skip, or n > 1 forks
                logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
            allowed, dead_ends = self._allowed_tokens(masks, mask_keys)
            tokens, logprobs = self.sampler(logits, sample_seqs, allowed)
            if allowed is not None:
                dead_ends |= self._advance_matchers(sample_seqs, tokens, allowed.rows, dead_ends)
            for i, (seq, token, logprob) in enumerate(zip(sample_seqs, tokens, logprobs, strict=True)):
                if i in dead_ends:
                    deltas.append(self._dead_end(seq))
                else:
                    deltas.append(self._append_token(seq, token, logprob))
            if allowed is not None:
                self._start_next_masks([sample_seqs[i] for i in allowed.rows if i not in dead_ends])
        return deltas

    def _finish_masks(self, masks: MaskFill) -> None:
        """Waits for these masks; a row llguidance could not mask is stuck for good: its mask stays empty (a
        dead end when it next samples) and nothing touches its matcher again (a stuck call holds it)."""
        assert self._mask_filler is not None
        for row in self._mask_filler.finish(masks):
            masks.seqs[row].is_grammar_stuck = True

    def _start_masks(self, scheduled: list[ScheduledSeq]) -> MaskFill | None:
        """The token masks of the constrained sequences that sample this step: the ones started as the last
        step ended where they cover them all (a row of a sequence not in this step goes unused), else a fill
        started now."""
        constrained = [s.seq for s in scheduled if s.seq.matcher is not None and s.completes]
        early, self._next_masks = self._next_masks, None
        if early is not None:
            if constrained and all(seq.seq_id in early.row_of for seq in constrained):
                return early
            self._finish_masks(early)  # NOTE: its matchers are borrowed until it ends
        if not constrained:
            return None
        return self._filler().start(constrained)

    def _start_next_masks(self, sampled: list[Sequence]) -> None:
        """Starts the next step's masks of the constrained completions that sampled and go on."""
        going_on = [seq for seq in sampled
                    if not seq.is_grammar_stuck and seq.status is SequenceStatus.RUNNING]
        if going_on:
            self._next_masks = self._filler().start(going_on)

    def _filler(self) -> MaskFiller:
        if self._mask_filler is None:
            from engine_server.engine.structured.masks import MaskFiller

            self._mask_filler = MaskFiller(self.model_info.vocab_size,
                                           timeout_s=self.config.grammar_mask_timeout_s)
        return self._mask_filler

    def _allowed_tokens(self, masks: MaskFill | None, mask_keys: list[int | None]
                        ) -> tuple[AllowedTokens | None, set[int]]:
        """The sampler's view of this step's masks, and the rows whose constraint allows no token at all."""
        if masks is None:
            return None, set()
        rows = [i for i, key in enumerate(mask_keys) if key is not None]
        allowed = masks.allowed(rows, [key for key in mask_keys if key is not None])
        has_any = allowed.bitmask.any(axis=1)
        dead_ends = {rows[j] for j in np.flatnonzero(~has_any).tolist()}
        if dead_ends:  # NOTE: sampled from everything only to keep the batch's shapes; the token is dropped
            allowed.bitmask[~has_any] = -1
        return allowed, dead_ends

    def _advance_matchers(self, seqs: list[Sequence], tokens: list[int], rows: list[int], dead_ends: set[int]
                          ) -> set[int]:
        """Each constrained row's matcher takes its sampled token; the rows whose matcher refused it, or was
        in error already (its mask then allows only EOS: llguidance's "stop", not the language's end).

        NOTE: one at a time: ~1 us a row, cheaper than waking llguidance's thread pool (consume_token_par)."""
        return {i for i in rows if i not in dead_ends and (
            seqs[i].matcher.is_error() or not seqs[i].matcher.consume_token(tokens[i]))}  # type: ignore[union-attr]

    def _sampling_rows(self, step_logits: StepLogits, ordered: list[ScheduledSeq]
                       ) -> tuple[list[Sequence], list[int], list[int | None]]:
        """Sequences that sample, their logits rows, and whose token mask each one takes (None: unconstrained;
        a fork takes its parent's: they start from the same state)."""
        seqs: list[Sequence] = []
        rows: list[int] = []
        mask_keys: list[int | None] = []
        for s in ordered:
            row = step_logits.sample_rows.get(s.seq.seq_id)
            if row is None:
                continue
            key = s.seq.seq_id if s.seq.matcher is not None else None
            if s.seq.is_abort_pending:  # its prompt was computed for its siblings: now it can go
                self._pending_completion_aborts.append((s.seq.request_id, s.seq.index))
            else:
                seqs.append(s.seq)
                rows.append(row)
                mask_keys.append(key)
            if s.seq.num_siblings_to_fork:
                # n > 1: the prompt is computed once; siblings sample from the same logits row.
                for sibling in self._fork(s.seq):
                    seqs.append(sibling)
                    rows.append(row)
                    mask_keys.append(key)
        return seqs, rows, mask_keys

    def _fork(self, parent: Sequence) -> list[Sequence]:
        state = self._requests[parent.request_id]
        siblings = []
        num_shared_blocks = parent.num_prompt_tokens // self.block_manager.block_size
        for index in range(1, parent.num_siblings_to_fork + 1):
            if index in state.finished_indices:  # aborted before it existed
                continue
            child = self._new_sequence(state.request, index, list(parent.token_ids), parent.max_tokens)
            child.arrival = parent.arrival  # NOTE: the request's place in the queue, not the fork's
            child.lora_slot = parent.lora_slot  # (the request's pin covers all its completions)
            if parent.is_grammar_stuck:  # (its row's empty mask ends the child too)
                child.is_grammar_stuck = True
            elif parent.matcher is not None:  # NOTE: forked before the parent's first token: the start state
                child.matcher = parent.matcher.deep_copy()
            # NOTE: only full prompt blocks are shared; the child recomputes the partial tail
            # (< block_size tokens) into its own block, so no block is ever written by two owners.
            self.block_manager.share(parent, child, num_shared_blocks)
            self.scheduler.add_running(child)
            state.seqs[index] = child
            siblings.append(child)
        parent.num_siblings_to_fork = 0
        return siblings

    def _collect_prompt_logprobs(self, step_logits: StepLogits, ordered: list[ScheduledSeq]) -> None:
        for s in ordered:
            span = step_logits.prompt_rows.get(s.seq.seq_id)
            if span is None:
                continue
            first_row, num_rows, first_pos = span
            seq = s.seq
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]  # the first prompt token has no logprob
            lps = torch.log_softmax(step_logits.logits[first_row:first_row + num_rows], dim=-1)
            targets = torch.tensor(seq.token_ids[first_pos + 1:first_pos + 1 + num_rows], device=lps.device)
            k = int(seq.params.prompt_logprobs or 0)
            seq.prompt_logprobs.extend(logprobs_of(lps, targets, [k] * num_rows))

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> CompletionDelta:
        seq.token_ids.append(token)
        params = seq.params
        delta = CompletionDelta(request_id=seq.request_id, index=seq.index, new_token_ids=[token],
                                logprobs=[logprob] if logprob is not None else None)
        if seq.is_first_output:
            seq.is_first_output = False
            if seq.index == 0:
                delta.num_prompt_tokens = seq.num_prompt_tokens
                delta.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
                if params.prompt_logprobs is not None:
                    delta.prompt_logprobs = seq.prompt_logprobs or [None]
                    seq.prompt_logprobs = None
        is_stop = token in params.stop_token_ids or (
            not params.ignore_eos and token in self.model_info.eos_token_ids)
        if is_stop and seq.num_output_tokens >= params.min_tokens:
            delta.finish_reason, delta.stop_token_id = FinishReason.STOP, token
        elif seq.matcher is not None and seq.matcher.is_stopped():
            # the constraint's sentence is complete and cannot go on (wins over min_tokens and ignore_eos)
            delta.finish_reason = FinishReason.STOP
            if token in params.stop_token_ids or token in self.model_info.eos_token_ids:
                delta.stop_token_id = token
        elif seq.num_output_tokens >= seq.max_tokens:
            delta.finish_reason = FinishReason.LENGTH
        if delta.finish_reason is not None:
            self._finish(seq)
        return delta

    def _dead_end(self, seq: Sequence) -> CompletionDelta:
        """The constraint allows no next token: the completion ends with what it has (no token is added)."""
        logger.debug("request %s completion %d: constraint dead end (%s)", seq.request_id, seq.index,
                     "stuck" if seq.is_grammar_stuck or seq.matcher is None else seq.matcher.get_error())
        delta = CompletionDelta(request_id=seq.request_id, index=seq.index, new_token_ids=[],
                                finish_reason=FinishReason.DEAD_END)
        if seq.is_first_output:
            seq.is_first_output = False
            if seq.index == 0:
                delta.num_prompt_tokens = seq.num_prompt_tokens
                delta.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
        self._finish(seq)
        return delta

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._end_completion(self._requests[seq.request_id], seq.index)

    def _end_completion(self, state: _RequestState, index: int) -> None:
        state.seqs.pop(index, None)
        state.finished_indices.add(index)
        if len(state.finished_indices) == state.request.params.n:
            del self._requests[state.request.request_id]
            self._unpin_adapter(state.request)

    def _process_aborts(self) -> list[CompletionDelta]:
        deltas = []
        for request_id in self._pending_aborts:
            state = self._requests.pop(request_id, None)
            if state is None:
                continue
            self._unpin_adapter(state.request)
            self._compiling.pop(request_id, None)
            for seq in state.seqs.values():
                self.scheduler.remove(seq)
            for index in range(state.request.params.n):
                if index not in state.finished_indices:
                    deltas.append(CompletionDelta(request_id=request_id, index=index, new_token_ids=[],
                                                  finish_reason=FinishReason.ABORT))
        self._pending_aborts.clear()
        # NOTE: highest index first, so that index 0 (which computes the prompt for the siblings it has
        # yet to fork) sees which of them are still wanted.
        completions = sorted(self._pending_completion_aborts, key=lambda c: -c[1])
        self._pending_completion_aborts.clear()
        for request_id, index in completions:
            state = self._requests.get(request_id)
            if state is not None and index not in state.finished_indices:  # else it ended meanwhile
                delta = self._abort_completion(state, index)
                if delta is not None:
                    deltas.append(delta)
        return deltas

    def _abort_completion(self, state: _RequestState, index: int) -> CompletionDelta | None:
        seq = state.seqs.get(index)
        if seq is not None and seq.num_siblings_to_fork and any(
                i not in state.finished_indices for i in range(1, state.request.params.n)):
            seq.is_abort_pending = True  # it ends once its siblings are forked
            return None
        if seq is not None:  # (None: a sibling not forked yet; the fork skips it)
            self.scheduler.remove(seq)
        self._end_completion(state, index)
        return CompletionDelta(request_id=state.request.request_id, index=index, new_token_ids=[],
                               finish_reason=FinishReason.ABORT)
