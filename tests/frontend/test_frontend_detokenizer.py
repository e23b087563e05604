"""Incremental detokenization equals decoding the whole sequence at once (randomized), on the tiny model's
byte-level BPE tokenizer, where emoji and CJK characters are split across tokens.
"""

from __future__ import annotations

import random

import pytest
from engine_server.frontend.byte_level import ByteLevelDecoder
from engine_server.frontend.detokenizer import Detokenizer, IncrementalDetokenizer
from engine_server.frontend.tokenizer import Tokenizer

SAMPLES = (
    "Hello, world!", "你好\uff0c世界\u3002这是一个测试", "🎉🚀😀 emoji 👩‍👩‍👧 family", "naïve café — ½ ∑ ∞",
    "日本語のテキスト", "한국어 텍스트", "مرحبا بالعالم", "mixed 混合 🎉 text\nwith lines\t and tabs",
)


def _stream(detokenizer: Detokenizer, token_ids: list[int], rng: random.Random, full: str) -> str:
    """Feeds the ids in random-sized groups (as coalesced engine deltas would arrive), then finishes; every
    piece released must be final (the text so far is a prefix of the full decode)."""
    pieces = []
    position = 0
    while position < len(token_ids):
        size = rng.randint(1, 3)
        pieces.append(detokenizer.add_many(token_ids[position:position + size]))
        assert full.startswith("".join(pieces)), token_ids
        position += size
    pieces.append(detokenizer.finish())
    return "".join(pieces)


def _random_ids(tokenizer: Tokenizer, rng: random.Random) -> list[int]:
    kind = rng.random()
    if kind < 0.4:  # arbitrary ids, special tokens and invalid UTF-8 byte sequences included
        return [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
    text = "".join(rng.choice(SAMPLES) for _ in range(rng.randint(1, 3)))
    ids = tokenizer.encode(text, add_special_tokens=False).token_ids
    if kind < 0.7:  # a slice that starts and ends inside multi-byte characters
        start = rng.randrange(len(ids))
        return ids[start:start + rng.randint(1, len(ids))]
    return ids


MODES = ["byte_tables", "decode_stream", "prefix_offsets"]


def _detokenizer(tokenizer: Tokenizer, mode: str, *, skip_special_tokens: bool) -> Detokenizer:
    if mode == "byte_tables":
        assert tokenizer.byte_tables is not None  # the tiny model's tokenizer is byte-level BPE
        detokenizer = tokenizer.detokenizers.new([], skip_special_tokens=skip_special_tokens)
        assert isinstance(detokenizer, ByteLevelDecoder)
        return detokenizer
    return IncrementalDetokenizer(
        tokenizer.backend, skip_special_tokens=skip_special_tokens, use_decode_stream=mode == "decode_stream"
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_equals_full_decode(tokenizer: Tokenizer, mode: str, skip_special_tokens: bool) -> None:
    rng = random.Random(1234)
    for _ in range(400):
        token_ids = _random_ids(tokenizer, rng)
        detokenizer = _detokenizer(tokenizer, mode, skip_special_tokens=skip_special_tokens)
        full = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert _stream(detokenizer, token_ids, rng, full) == full, token_ids


@pytest.mark.parametrize("mode", MODES)
def test_partial_characters_are_held_back(tokenizer: Tokenizer, mode: str) -> None:
    token_ids = tokenizer.encode("a🎉b", add_special_tokens=False).token_ids
    assert len(token_ids) > 3  # the emoji's four bytes span several tokens
    detokenizer = _detokenizer(tokenizer, mode, skip_special_tokens=True)
    pieces = [detokenizer.add(token_id) for token_id in token_ids]
    assert "\ufffd" not in "".join(pieces)
    assert [piece for piece in pieces if piece] == ["a", "🎉", "b"]
    assert detokenizer.finish() == ""


@pytest.mark.parametrize("mode", MODES)
def test_a_sequence_ending_mid_character_flushes_like_a_full_decode(tokenizer: Tokenizer, mode: str) -> None:
    token_ids = tokenizer.encode("ok🎉", add_special_tokens=False).token_ids[:-1]
    detokenizer = _detokenizer(tokenizer, mode, skip_special_tokens=True)
    streamed = "".join(detokenizer.add(token_id) for token_id in token_ids)
    assert streamed == "ok"
    assert streamed + detokenizer.finish() == tokenizer.decode(token_ids)  # ends in U+FFFD, as decode does
