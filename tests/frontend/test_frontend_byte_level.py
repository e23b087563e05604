"""frontend/byte_level.py: the tables are built only for a plain byte-level decoder, and only when they
reproduce the tokenizer's decode (the detokenizer tests check the streamed text itself)."""

from __future__ import annotations

import pytest
from engine_server.frontend import byte_level
from engine_server.frontend.byte_level import ByteLevelTables
from engine_server.frontend.tokenizer import Tokenizer
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models


def test_tables_for_the_tiny_models_byte_level_bpe(tokenizer: Tokenizer) -> None:
    tables = ByteLevelTables.build(tokenizer.backend)
    assert tables is not None
    special = sorted(tokenizer.special_ids)
    assert special
    assert all(tables.skip_special[i] == b"" for i in special)
    assert all(tables.keep_special[i] for i in special)


def test_a_whole_tokens_text_is_its_decode_and_the_rest_are_left_to_the_decoder(tokenizer: Tokenizer) -> None:
    tables = ByteLevelTables.build(tokenizer.backend)
    assert tables is not None
    for skip, texts in ((True, tables.skip_texts), (False, tables.keep_texts)):
        assert len(texts) == len(tables.table(skip_special_tokens=skip))
        for token_id, text in enumerate(texts):
            decoded = tokenizer.decode([token_id], skip_special_tokens=skip)
            if text is None:  # bytes of an incomplete character: decode alone shows U+FFFD
                assert "\ufffd" in decoded, token_id
            else:
                assert text == decoded, token_id
    assert None in tables.keep_texts  # the tiny vocabulary has tokens that are parts of characters
    assert all(tables.skip_texts[i] == "" and tables.keep_texts[i] for i in tokenizer.special_ids)


def test_ids_past_the_tokenizer_vocabulary_decode_to_nothing_as_decode_does(tokenizer: Tokenizer) -> None:
    assert tokenizer.byte_tables is not None
    ids = [300, tokenizer.vocab_size + 7, 301]
    decoder = tokenizer.byte_tables.decoder(skip_special_tokens=True)
    assert decoder.add_many(ids) + decoder.finish() == tokenizer.decode(ids)
    decoder = tokenizer.byte_tables.decoder(skip_special_tokens=True)
    assert "".join(decoder.add(i) for i in ids) + decoder.finish() == tokenizer.decode(ids)


def test_no_tables_for_another_decoder() -> None:
    backend = RustTokenizer(models.WordLevel({"a": 0, "##b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    assert ByteLevelTables.build(backend) is None


def test_tables_that_do_not_reproduce_decode_are_refused(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Wrong on purpose: the token's characters as UTF-8 instead of the bytes they stand for ("Ġ" is a space).
    monkeypatch.setattr(byte_level, "_token_bytes", lambda token, char_to_byte: token.encode("utf-8"))
    assert ByteLevelTables.build(tokenizer.backend) is None
    assert "do not reproduce" in caplog.text
