"""Byte-level BPE detokenization by table lookup: one bytes object per token id, joined and fed to an
incremental UTF-8 decoder.

A byte-level BPE vocabulary (GPT-2, Llama 3, Qwen, the tiny model's) spells every byte as one printable
character; its decoder maps each token's characters back to bytes and decodes the whole byte string as
UTF-8 (invalid sequences become U+FFFD). Done incrementally by `tokenizers.decoders.DecodeStream`, that costs
~0.9 us per token (a Python -> Rust call and a window re-decode per token); a table lookup and Python's
incremental UTF-8 decoder release the same text for ~0.3 us here. The table is only used for a tokenizer whose
decoder is exactly `ByteLevel`, and only after it reproduced `decode` on a probe set of sequences (every added
token, random ids, sequences cut inside characters); otherwise DecodeStream stays.

Most streamed messages carry one token, and most tokens are whole UTF-8 characters on their own: for those the
text is a second table's string, with no decoder call (~0.6 -> ~0.3 us a token here).
"""

from __future__ import annotations

import logging
import random
from codecs import utf_8_decode as _utf_8_decode
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

_PROBE_SEQUENCES = 200
_REPLACEMENT = "\ufffd"
_MAX_CONTEXT_TOKENS = 8  # the last ids that hold a prompt's incomplete last character (4 bytes at most)


def _char_to_byte() -> dict[str, int]:
    # The byte-level alphabet: printable Latin-1 bytes stand for themselves; the other 68 bytes (controls,
    # space, 0x7F-0xA0, 0xAD) are shifted to U+0100 onwards, in byte order.
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in mapping.values())
    mapping.update({chr(0x100 + i): b for i, b in enumerate(shifted)})
    return mapping


def _token_bytes(token: str, char_to_byte: dict[str, int]) -> bytes:
    try:
        return bytes([char_to_byte[char] for char in token])
    except KeyError:  # a token outside the alphabet (an added token such as "<|im_start|>" with odd chars)
        return token.encode("utf-8")


def _whole_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def whole_texts(table: list[bytes]) -> list[str | None]:
    """Per token id, its text where its bytes are whole UTF-8 characters (decoded after nothing held back,
    that is all they give), else None (an incomplete or invalid sequence: the incremental decoder decides)."""
    return [_whole_text(data) for data in table]


class ByteLevelTables:
    """Per tokenizer: the bytes of every token id, with special tokens kept or skipped (and `whole_texts` of
    each)."""

    __slots__ = ("keep_special", "keep_texts", "skip_special", "skip_texts")

    def __init__(self, keep_special: list[bytes], skip_special: list[bytes]) -> None:
        self.keep_special = keep_special
        self.skip_special = skip_special
        self.keep_texts = whole_texts(keep_special)
        # (the skip table is the other with special tokens blanked: elsewhere the same strings serve both)
        pairs = zip(self.keep_texts, skip_special, keep_special, strict=True)
        self.skip_texts = [text if data is kept else _whole_text(data) for text, data, kept in pairs]

    def table(self, *, skip_special_tokens: bool) -> list[bytes]:
        return self.skip_special if skip_special_tokens else self.keep_special

    def decoder(self, *, skip_special_tokens: bool, prompt_context: Sequence[int] = ()) -> ByteLevelDecoder:
        """A new completion's decoder, after `prompt_context` (`prompt_context`: empty, or where the prompt
        may end inside a character, its last ids)."""
        if skip_special_tokens:
            table, texts = self.skip_special, self.skip_texts
        else:
            table, texts = self.keep_special, self.keep_texts
        if not prompt_context:
            return ByteLevelDecoder(table, texts)
        size = len(table)
        data = b"".join([table[token_id] for token_id in prompt_context if 0 <= token_id < size])
        _, consumed = _utf_8_decode(data, "replace", False)
        if consumed == len(data):
            return ByteLevelDecoder(table, texts)
        return _AfterPartialCharacter(table, texts, pending=data[consumed:])

    def prompt_context(self, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool) -> list[int]:
        """Nothing for a prompt that ends on a character boundary (byte-level text needs no context: its
        decoder drops nothing), else its last ids, whose incomplete character the completion may complete."""
        texts = self.skip_texts if skip_special_tokens else self.keep_texts
        if prompt_token_ids:
            last = prompt_token_ids[-1]
            if 0 <= last < len(texts) and texts[last]:  # whole characters: the last ends on a boundary
                return []
        return list(prompt_token_ids[-_MAX_CONTEXT_TOKENS:])

    @classmethod
    def build(cls, backend: Any) -> ByteLevelTables | None:
        """The tables for a `tokenizers.Tokenizer`, or None when its decoder is not plain byte-level BPE or
        the tables would not reproduce its `decode` exactly."""
        from tokenizers import decoders

        if type(backend.decoder) is not decoders.ByteLevel:
            return None
        char_to_byte = _char_to_byte()
        size = backend.get_vocab_size(with_added_tokens=True)
        keep: list[bytes] = []
        for token_id in range(size):
            token = backend.id_to_token(token_id)
            keep.append(b"" if token is None else _token_bytes(token, char_to_byte))
        skip = list(keep)
        added_tokens = backend.get_added_tokens_decoder()
        special_ids = [token_id for token_id, added in added_tokens.items() if added.special]
        for token_id in special_ids:
            if token_id < size:
                skip[token_id] = b""
        tables = cls(keep, skip)
        if not tables._reproduces_decode(backend, sorted(added_tokens)):
            logger.warning("byte-level detokenization tables do not reproduce the tokenizer's decode; "
                           "using tokenizers' DecodeStream")
            return None
        return tables

    def _reproduces_decode(self, backend: Any, added_ids: list[int]) -> bool:
        rng = random.Random(0)
        size = len(self.keep_special)
        # Every added token (special or not: their text may sit outside the byte alphabet), the first ids,
        # then random sequences, which cut multi-byte characters anywhere.
        probes = [added_ids, list(range(min(size, 512)))]
        probes += [[token_id, rng.randrange(size)] for token_id in added_ids]
        probes += [[rng.randrange(size) for _ in range(rng.randint(1, 24))] for _ in range(_PROBE_SEQUENCES)]
        for ids in probes:
            for skip in (True, False):
                decoder = self.decoder(skip_special_tokens=skip)
                streamed = "".join(decoder.add(token_id) for token_id in ids) + decoder.finish()
                if streamed != backend.decode(ids, skip_special_tokens=skip):
                    return False
        return True


class ByteLevelDecoder:
    """One completion's incremental decoder: text is released once its characters are complete."""

    __slots__ = ("_pending", "_table", "_texts")

    def __init__(self, table: list[bytes], texts: list[str | None], *, pending: bytes = b"") -> None:
        self._table = table
        self._texts = texts  # whole_texts(table), built once per tokenizer (ByteLevelTables.decoder)
        self._pending = pending  # the bytes of an incomplete character at the end, held back

    def add(self, token_id: int) -> str:
        table = self._table
        if not 0 <= token_id < len(table):  # past the tokenizer's vocabulary: decodes to ""
            return self._decode(b"")
        if not self._pending:
            text = self._texts[token_id]
            if text is not None:
                return text
        return self._decode(table[token_id])

    def add_many(self, token_ids: list[int]) -> str:
        if len(token_ids) == 1 and not self._pending:  # one whole token: its text as it is
            try:
                text = self._texts[token_ids[0]]
            except IndexError:  # past the tokenizer's vocabulary: decodes to "" (as below)
                return ""
            if text is not None:
                return text
        table = self._table
        try:
            data = table[token_ids[0]] if len(token_ids) == 1 else b"".join([table[i] for i in token_ids])
        except IndexError:  # an id past the tokenizer's vocabulary (a padded model vocabulary): decodes to ""
            size = len(table)
            data = b"".join([table[i] if 0 <= i < size else b"" for i in token_ids])
        return self._decode(data)

    def finish(self) -> str:
        """What is held back (an incomplete character, as U+FFFD, as a full decode shows it)."""
        text, _ = _utf_8_decode(self._pending, "replace", True)
        self._pending = b""
        return text

    def _decode(self, data: bytes) -> str:
        # NOTE: codecs' C decoder with final=False, as Python's incremental decoder calls it (its wrapper is
        # Python code and cost more than the decoding): an incomplete last character is not consumed.
        if self._pending:
            data = self._pending + data
        text, consumed = _utf_8_decode(data, "replace", False)
        self._pending = data[consumed:] if consumed < len(data) else b""
        return text


class _AfterPartialCharacter(ByteLevelDecoder):
    """The decoder of a completion whose prompt ends inside a character (token ids cut there): the prompt's
    bytes of it start pending; a completion that completes the character starts with it, otherwise the U+FFFD
    that the prompt's text shows for them is not repeated (the text is exactly decode(prompt + completion)
    minus decode(prompt) then). A subclass, so that other completions' decoding pays nothing for it.
    """

    __slots__ = ("_is_prompt_pending",)

    def __init__(self, table: list[bytes], texts: list[str | None], *, pending: bytes) -> None:
        super().__init__(table, texts, pending=pending)
        self._is_prompt_pending = True

    def finish(self) -> str:
        text = super().finish()
        return self._after_prompt(text) if self._is_prompt_pending else text

    def _decode(self, data: bytes) -> str:
        text = super()._decode(data)
        return self._after_prompt(text) if self._is_prompt_pending and text else text

    def _after_prompt(self, text: str) -> str:
        # The first text decoded from the prompt's pending bytes: U+FFFD first when they did not form a
        # character (the prompt's text shows that one already), else the character they completed.
        self._is_prompt_pending = False
        return text[1:] if text.startswith(_REPLACEMENT) else text
