"""Incremental detokenization whose concatenated output equals decoding the whole sequence at once.

Text is only released once it is final: a token that ends inside a multi-byte UTF-8 character (byte-level
BPE splits emoji and CJK across tokens) yields "" until the character completes. `finish()` reconciles with
one full decode, so the total is exact even for sequences that end mid-character (the full decode shows
U+FFFD there) or for decoders whose output is not local.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from engine_server.frontend.byte_level import ByteLevelTables

logger = logging.getLogger(__name__)

try:  # tokenizers >= 0.21: the prefix/read-offset algorithm in Rust
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - depends on the installed tokenizers
    _DecodeStream = None  # type: ignore[misc,assignment,unused-ignore]

_REPLACEMENT = "\ufffd"


class Detokenizer(Protocol):
    """One completion's text: `add`/`add_many` return what became final; `finish` the rest."""

    def add(self, token_id: int) -> str: ...
    def add_many(self, token_ids: list[int]) -> str: ...
    def finish(self) -> str: ...


def new_detokenizer(
    backend: Any, *, skip_special_tokens: bool, byte_tables: ByteLevelTables | None
) -> Detokenizer:
    """A table lookup for byte-level BPE with verified tables (frontend/byte_level.py); otherwise
    tokenizers' DecodeStream (or the prefix-offset method where it is missing)."""
    if byte_tables is not None:
        return byte_tables.decoder(skip_special_tokens=skip_special_tokens)
    return IncrementalDetokenizer(backend, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas; one per completion."""

    __slots__ = ("_backend", "_emitted_len", "_ids", "_prefix", "_read", "_skip_special", "_stream")

    def __init__(self, backend: Any, *, skip_special_tokens: bool, use_decode_stream: bool = True) -> None:
        self._backend = backend  # a tokenizers.Tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._emitted_len = 0  # characters released so far
        self._stream: Any = (
            _DecodeStream(skip_special_tokens=skip_special_tokens)
            if use_decode_stream and _DecodeStream is not None
            else None
        )
        self._prefix = 0  # fallback state: ids[prefix:read] were decoded as context, ids[read:] are pending
        self._read = 0

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text that became final ("" if none yet)."""
        self._ids.append(token_id)
        if self._stream is not None:
            piece: str | None = self._stream.step(self._backend, token_id)
            if piece is None:
                return ""
        else:
            piece = self._step_fallback()
        self._emitted_len += len(piece)
        return piece

    def add_many(self, token_ids: list[int]) -> str:
        if len(token_ids) == 1:
            return self.add(token_ids[0])
        return "".join([self.add(token_id) for token_id in token_ids])

    def finish(self) -> str:
        """The rest of the text once no token will follow (held-back partial characters, as U+FFFD)."""
        full: str = self._backend.decode(self._ids, skip_special_tokens=self._skip_special)
        if len(full) < self._emitted_len:  # pragma: no cover - a decoder that is not prefix-stable
            logger.warning("incremental detokenization overshot the full decode; dropping the difference")
            return ""
        rest = full[self._emitted_len:]
        self._emitted_len = len(full)
        return rest

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
