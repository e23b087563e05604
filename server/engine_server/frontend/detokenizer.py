"""Incremental detokenization: a completion's text is decode(prompt + completion) minus decode(prompt),
released token by token.

The completion is decoded after a few of the prompt's last tokens, as vLLM's prefix offsets do: decoders
whose output depends on the neighbours (SentencePiece's Metaspace drops the leading space of the first token
only; byte-fallback bytes merge into characters) then see the same context as a full decode, so the
completion of "The capital of France is" is " Paris", not "Paris". Byte-level BPE needs no context (its
decoder maps each token to bytes and drops nothing): `byte_level.py` serves it by table lookup.

Text is only released once it is final: a token that ends inside a multi-byte UTF-8 character yields ""
until the character completes, and byte-fallback tokens (`<0xE2>`: SentencePiece's bytes, which a full
decode turns into U+FFFD all together when any of a run is invalid) until a token that is not a byte ends
their run. `finish()` reconciles with one full decode, so the total is exact even for sequences that end
mid-character (the full decode shows U+FFFD there).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

from engine_server.frontend.byte_level import ByteLevelTables

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# The prompt's last tokens decoded before the completion: 4 (vLLM's), more (up to 24) while those have no
# text of their own (skipped special tokens) or start inside a character.
_NUM_CONTEXT_TOKENS = 4
_MAX_CONTEXT_TOKENS = 24


def _decode_stream_type() -> Any:
    """tokenizers' DecodeStream (the prefix/read-offset algorithm in Rust) where its steps take a list of
    ids (a run of held-back bytes is stepped at once; older tokenizers take one id); None otherwise (the
    same algorithm in Python then)."""
    try:
        from tokenizers import Tokenizer, models
        from tokenizers.decoders import DecodeStream
    except ImportError:  # pragma: no cover - depends on the installed tokenizers
        return None
    probe = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    try:
        DecodeStream(skip_special_tokens=False).step(probe, [0])
    except TypeError:  # pragma: no cover - depends on the installed tokenizers
        return None
    return DecodeStream


_DecodeStream = _decode_stream_type()


class Detokenizer(Protocol):
    """One completion's text: `add`/`add_many` return what became final; `finish` the rest."""

    def add(self, token_id: int) -> str: ...
    def add_many(self, token_ids: list[int]) -> str: ...
    def finish(self) -> str: ...


def byte_fallback_ids(backend: Any) -> frozenset[int]:
    """The ids of the tokenizer's byte-fallback tokens (`<0x00>`..`<0xFF>`), if it has them."""
    ids = (backend.token_to_id(f"<0x{byte:02X}>") for byte in range(256))
    return frozenset(token_id for token_id in ids if token_id is not None)


class DetokenizerFactory:
    """Per tokenizer (built once, at load): a new detokenizer for each completion, and the prompt's context
    that all n completions of a request share."""

    __slots__ = ("_held_ids_keep", "_held_ids_skip", "_use_decode_stream", "backend", "byte_tables")

    def __init__(
        self, backend: Any, byte_tables: ByteLevelTables | None, *, use_decode_stream: bool = True
    ) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.byte_tables = byte_tables
        self._use_decode_stream = use_decode_stream  # False: the prefix-offset method in Python (for tests)
        # The ids that do not end a run of byte-fallback tokens: the bytes, and special tokens where they are
        # skipped (a full decode drops them before the bytes around them are joined).
        byte_ids = frozenset[int]() if byte_tables is not None else byte_fallback_ids(backend)
        added_tokens = backend.get_added_tokens_decoder()
        special_ids = [token_id for token_id, added in added_tokens.items() if added.special]
        self._held_ids_keep = byte_ids
        self._held_ids_skip = byte_ids | frozenset(special_ids) if byte_ids else byte_ids

    def prompt_context(self, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool) -> list[int]:
        """The prompt's last token ids that a completion is decoded after: the shortest of the last 4..24
        whose text is not empty and does not start inside a character (else the last 24), so that the
        completion's first token sees what a full decode shows before it (byte-level tables need none but
        a character the prompt ends inside of: ByteLevelTables.prompt_context)."""
        if self.byte_tables is not None:
            return self.byte_tables.prompt_context(prompt_token_ids, skip_special_tokens=skip_special_tokens)
        end = len(prompt_token_ids)
        start = max(0, end - _NUM_CONTEXT_TOKENS)
        lowest = max(0, end - _MAX_CONTEXT_TOKENS)
        while start > lowest:
            window = list(prompt_token_ids[start:])
            text: str = self.backend.decode(window, skip_special_tokens=skip_special_tokens)
            if text and not text.startswith(_REPLACEMENT):
                return window
            start -= 1
        return list(prompt_token_ids[start:])

    def new(self, prompt_context: list[int], *, skip_special_tokens: bool) -> Detokenizer:
        """A table lookup for byte-level BPE with verified tables (frontend/byte_level.py); otherwise
        tokenizers' DecodeStream (or the prefix-offset method where it is missing) after `prompt_context`."""
        if self.byte_tables is not None:
            return self.byte_tables.decoder(
                skip_special_tokens=skip_special_tokens, prompt_context=prompt_context)
        return IncrementalDetokenizer(
            self.backend, prompt_context=prompt_context, skip_special_tokens=skip_special_tokens,
            held_ids=self._held_ids_skip if skip_special_tokens else self._held_ids_keep,
            use_decode_stream=self._use_decode_stream,
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas; one per completion.

    The prompt's context is streamed first and its text dropped (priming): a prompt that ends inside a
    character, or on a run of byte-fallback tokens, leaves that text held back; the first text of the
    completion starts there, and drops it again when it is unchanged (the prompt's text shows it already).
    NOTE: the text is decode(context + completion) after its longest common prefix with decode(context):
    exactly decode(prompt + completion) minus decode(prompt) wherever the latter is a prefix of the former.
    """

    __slots__ = (
        "_backend", "_held_ids", "_held_text", "_ids", "_num_held", "_position", "_prefix", "_read",
        "_skip_special", "_stream",
    )

    def __init__(
        self, backend: Any, *, prompt_context: Sequence[int] = (), skip_special_tokens: bool,
        held_ids: frozenset[int] = frozenset(), use_decode_stream: bool = True,
    ) -> None:
        self._backend = backend  # a tokenizers.Tokenizer
        self._skip_special = skip_special_tokens
        self._held_ids = held_ids  # byte-fallback ids (and skipped special ones): no end to a run of bytes
        self._ids: list[int] = []  # the context's ids, then the completion's
        self._num_held = 0  # held ids at the end of `_ids`, not yet decoded
        self._position = 0  # characters of decode(self._ids) released (or dropped) so far
        self._stream: Any = (
            _DecodeStream(skip_special_tokens=skip_special_tokens)
            if use_decode_stream and _DecodeStream is not None
            else None
        )
        self._prefix = 0  # fallback state: ids[prefix:read] were decoded as context, ids[read:] are pending
        self._read = 0
        self._held_text = ""  # the text of decode(context) that priming did not release (see the class)
        if prompt_context and (not self.add_many(list(prompt_context)) or self._num_held):
            # (a step that releases text releases all of it: only then is nothing held back)
            full: str = backend.decode(list(prompt_context), skip_special_tokens=skip_special_tokens)
            self._held_text = full[self._position:]

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text that became final ("" if none yet)."""
        ids = self._ids
        ids.append(token_id)
        if token_id in self._held_ids:
            self._num_held += 1
            return ""
        if self._num_held:
            return self._decode(len(ids) - 1 - self._num_held)
        stream = self._stream
        if stream is None:
            return self._decode(len(ids) - 1)
        try:
            piece: str | None = stream.step(self._backend, token_id)
        except Exception as exc:
            piece = self._leave_decode_stream(exc, len(ids) - 1)
        if not piece:
            return ""
        self._position += len(piece)
        return self._drop_held(piece) if self._held_text else piece

    def add_many(self, token_ids: list[int]) -> str:
        if len(token_ids) == 1:
            return self.add(token_ids[0])
        start = len(self._ids) - self._num_held
        self._ids.extend(token_ids)
        held_ids = self._held_ids
        num_held = 0
        for token_id in reversed(token_ids):  # a run of bytes at the end stays held
            if token_id not in held_ids:
                break
            num_held += 1
        if num_held == len(token_ids):
            self._num_held += num_held
            return ""
        if not num_held:
            return self._decode(start)
        del self._ids[-num_held:]  # (decoded below without them, then put back, held)
        piece = self._decode(start)
        self._ids.extend(token_ids[-num_held:])
        self._num_held = num_held
        return piece

    def finish(self) -> str:
        """The rest of the text once no token will follow (held-back partial characters, as U+FFFD)."""
        full: str = self._backend.decode(self._ids, skip_special_tokens=self._skip_special)
        self._num_held = 0
        if len(full) < self._position:  # pragma: no cover - a decoder that is not prefix-stable
            logger.warning("incremental detokenization overshot the full decode; dropping the difference")
            return ""
        rest = full[self._position:]
        self._position = len(full)
        return self._drop_held(rest) if self._held_text and rest else rest

    def _decode(self, start: int) -> str:
        """Decodes `_ids[start:]`, the ids not yet stepped (held bytes included): one step for them all."""
        stream = self._stream
        piece: str | None
        if stream is None:
            piece = self._step_fallback()
        else:
            new_ids = self._ids[start:]
            try:
                piece = stream.step(self._backend, new_ids if len(new_ids) > 1 else new_ids[0])
            except Exception as exc:
                piece = self._leave_decode_stream(exc, start)
        self._num_held = 0
        if not piece:
            return ""
        self._position += len(piece)
        return self._drop_held(piece) if self._held_text else piece

    def _drop_held(self, piece: str) -> str:
        # The first text after the context starts where priming held back: the prompt's own text shows that
        # part already, so what the piece repeats of it is dropped (up to a U+FFFD the completion completed).
        held, self._held_text = self._held_text, ""
        if piece.startswith(held):
            return piece[len(held):]
        return piece[len(os.path.commonprefix([held, piece])):]

    def _leave_decode_stream(self, exc: Exception, start: int) -> str | None:
        # NOTE: DecodeStream raises when a window's text stops starting with what it released (a decoder
        # whose output is not prefix-stable; byte-fallback bytes were, until they are held back as above).
        # The prefix-offset method in Python compares lengths instead and never raises on valid ids: this
        # completion goes on with it, from one token of context before the ids being stepped (vLLM resets).
        logger.debug("DecodeStream refused a step (%s); going on with the prefix-offset method", exc)
        self._stream = None
        self._read = start
        self._prefix = max(0, start - 1)
        return self._step_fallback()

    def _step_fallback(self) -> str:
        # vLLM/TGI's method: decode a window with a few tokens of left context so that decoders that
        # depend on neighbours (leading-space handling, byte merging) see the same context as a full decode.
        decode = self._backend.decode
        skip = self._skip_special
        prefix_text: str = decode(self._ids[self._prefix:self._read], skip_special_tokens=skip)
        new_text: str = decode(self._ids[self._prefix:], skip_special_tokens=skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._prefix = self._read
            self._read = len(self._ids)
            return new_text[len(prefix_text):]
        return ""
