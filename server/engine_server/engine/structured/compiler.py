"""Compiles constraints into llguidance matchers off the step loop: a small thread pool and a bounded cache.

A request with a constraint waits (outside the scheduler) while its grammar compiles; the batch does not.
llguidance drops the GIL while it builds a grammar, so a compile runs beside the model's forward passes.
The same constraint compiles once: later requests (and the n completions of one) get copies of the compiled
matcher. Errors are cached too, so a bad constraint sent again is refused at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance

from engine_server.engine.structured.grammars import grammar_of
from engine_server.engine.types import RequestError, StructuredOutput

logger = logging.getLogger(__name__)

# NOTE: llguidance's own fuel limits bound how long one grammar's compile and each mask may take; these are
# its defaults, written out so that they are ours to document and change.
PARSER_LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000, max_grammar_size=500_000,
    verbose_errors=False,  # NOTE: errors go back to clients; they must not carry other state
)


@dataclass(frozen=True, slots=True)
class Compiled:
    """A compiled constraint: a matcher in its start state to copy, or why there is none."""

    matcher: llguidance.LLMatcher | None
    error: RequestError | None
    seconds: float


def load_llg_tokenizer(model_path: str, *, vocab_size: int, eos_token_ids: tuple[int, ...]
                       ) -> llguidance.LLTokenizer:
    """The model's tokenizer as llguidance needs it (its token bytes), from the model's local directory.

    NOTE: the vocabulary is the model's (its logits' width, which may be padded past the tokenizer's), and
    every id that ends a sequence counts as end of sequence.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    if not isinstance(hf, PreTrainedTokenizerFast):
        raise RuntimeError(f"structured output needs a fast tokenizer; {Path(model_path).name} has "
                           f"{type(hf).__name__}")
    from llguidance.hf import from_tokenizer

    return from_tokenizer(hf, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)


class _Entry:
    """One constraint's compile, shared by every request that asks for it while it runs."""

    __slots__ = ("constraint", "future", "started_at")

    def __init__(self, constraint: StructuredOutput) -> None:
        self.constraint = constraint
        self.future: Future[Compiled] = Future()
        self.started_at: float | None = None  # set when a pool thread starts on it


class CompileJob:
    """A request's wait for its constraint; `poll` says when it is over."""

    __slots__ = ("_compiler", "_entry", "constraint")

    def __init__(self, compiler: GrammarCompiler, constraint: StructuredOutput, entry: _Entry) -> None:
        self._compiler = compiler
        self._entry = entry
        self.constraint = constraint

    def poll(self, now: float) -> llguidance.LLMatcher | RequestError | None:
        """A fresh matcher, the error that refuses the request, or None while it still compiles."""
        entry = self._entry
        if entry.future.done():
            compiled = entry.future.result()
            if compiled.error is not None:
                return _renamed(compiled.error, self.constraint)
            assert compiled.matcher is not None
            return compiled.matcher.deep_copy()
        if entry.started_at is not None and now - entry.started_at > self._compiler.timeout_s:
            self._compiler.abandon(entry)
            return _renamed(self._compiler.timeout_error(), self.constraint)
        return None

    def wait(self, timeout_s: float) -> None:
        """Blocks up to `timeout_s` for the compile (the core loop's wait when nothing else can run)."""
        with contextlib.suppress(TimeoutError):
            self._entry.future.exception(timeout=timeout_s)


class GrammarCompiler:
    def __init__(self, *, model_path: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 num_threads: int = 1, timeout_s: float = 10.0, cache_size: int = 256) -> None:
        self.timeout_s = timeout_s
        self._model_path = model_path
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, _Entry] = OrderedDict()
        self._num_threads = num_threads
        self._pool = self._new_pool()
        self._queued: dict[_Entry, None] = {}  # submitted, not started: what a new pool must take over
        self.num_abandoned = 0  # compiles that never returned (their threads spin on, out of our reach)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: RuntimeError | None = None
        # NOTE: its own lock: building the tokenizer takes up to a second, and `submit` (the step loop) must
        # never wait for that
        self._tokenizer_lock = threading.Lock()
        self._pool.submit(lambda: self.tokenizer)  # built at start-up, beside the model's warm-up

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer (built once, in a pool thread)."""
        with self._tokenizer_lock:
            if self._tokenizer is None and self._tokenizer_error is None:
                try:
                    self._tokenizer = load_llg_tokenizer(self._model_path, vocab_size=self._vocab_size,
                                                         eos_token_ids=self._eos_token_ids)
                except Exception as exc:
                    logger.exception("cannot build llguidance's tokenizer for %s", self._model_path)
                    self._tokenizer_error = RuntimeError(f"this model's tokenizer cannot be used for "
                                                         f"structured output: {exc}")
            if self._tokenizer_error is not None:
                raise self._tokenizer_error
            assert self._tokenizer is not None
            return self._tokenizer

    def submit(self, constraint: StructuredOutput) -> CompileJob:
        # NOTE: the key leaves out the field name: the same language sent by either service compiles once.
        key = constraint if not constraint.field_name else _without_field_name(constraint)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
            else:
                entry = _Entry(key)
                self._cache[key] = entry
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                self._queued[entry] = None
                self._pool.submit(self._compile, entry)
        return CompileJob(self, constraint, entry)

    def abandon(self, entry: _Entry) -> None:
        """A compile past its timeout: its outcome is the timeout error (for every later request too), and if
        it still runs, its thread is left to it and the queued compiles move to a fresh pool.

        NOTE: a compile that never returns (a grammar llguidance loops on) would otherwise hold a compile
        thread for good, and every constraint queued behind it would wait forever.
        """
        with self._lock:
            if entry.future.done():
                return
            entry.future.set_result(Compiled(None, self.timeout_error(), self.timeout_s))
            self.num_abandoned += 1
            logger.error("a %s constraint did not compile within %g s; its thread is abandoned (%d so far)",
                         entry.constraint.kind.value, self.timeout_s, self.num_abandoned)
            old, self._pool = self._pool, self._new_pool()
            old.shutdown(wait=False, cancel_futures=True)
            for queued in self._queued:
                self._pool.submit(self._compile, queued)

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self._num_threads, thread_name_prefix="grammar-compile",
                                  initializer=_lower_priority)

    def timeout_error(self) -> RequestError:
        return RequestError("", f"took longer than {self.timeout_s:g} s to compile")

    def _compile(self, entry: _Entry) -> None:
        with self._lock:
            if entry not in self._queued:  # a second pool took it over, or it was abandoned
                return
            del self._queued[entry]
        constraint = entry.constraint
        start = time.monotonic()
        matcher = None
        error: RequestError | None = None
        try:
            # NOTE: the tokenizer is built once, by the first compile: not this constraint's compile time
            tokenizer = self.tokenizer
            entry.started_at = start = time.monotonic()
            grammar = grammar_of(constraint)
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
            # NOTE: the first mask builds the lexer states of the start; here it costs no step any time, and a
            # grammar that cannot even start fails now rather than in the batch
            matcher.compute_bitmask()
            if matcher.is_error():
                # NOTE: a panic in llguidance ends with a native backtrace (build paths): not for clients
                message = matcher.get_error().split("\n<backtrace>", 1)[0]
                error, matcher = RequestError("", message), None
        except RequestError as exc:
            error = exc
        except Exception as exc:  # the tokenizer, or the library failing on an input it should refuse
            logger.exception("compiling a %s constraint failed", constraint.kind.value)
            error = RequestError("", f"cannot be compiled: {exc}")
        seconds = time.monotonic() - start
        if error is None and seconds > self.timeout_s:
            # NOTE: its request got its timeout error; a later one with this constraint gets it at once
            error, matcher = self.timeout_error(), None
        with self._lock:
            if not entry.future.done():  # (else abandoned meanwhile)
                entry.future.set_result(Compiled(matcher, error, seconds))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# A compile thread's nice value: the step loop (and the mask fills it waits for) get the CPU first, so a burst
# of expensive constraints slows their own admission, not the running requests' steps.
COMPILE_NICENESS = 10


def _lower_priority() -> None:
    """In a compile thread (Linux: a thread has its own nice value); elsewhere a no-op."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)


def _renamed(error: RequestError, constraint: StructuredOutput) -> RequestError:
    """A compile error (cached: shared by every request with the same constraint) naming this request's field.

    NOTE: errors are made for a constraint without a field name: their field is the kind's value, or a path
    inside it ("structural_tag.tags[0].json_schema"), or "" for the constraint as a whole.
    """
    base = constraint.field_name or constraint.kind.value
    suffix = error.field_name.removeprefix(constraint.kind.value)
    return RequestError(base + suffix, error.detail)


def _without_field_name(constraint: StructuredOutput) -> StructuredOutput:
    return StructuredOutput(constraint.kind, constraint.spec, constraint.choices, constraint.tags,
                            constraint.triggers)
