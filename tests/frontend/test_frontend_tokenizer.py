"""The frontend's tokenizer wrapper on the tiny model's byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_server.engine.types import RequestError
from engine_server.frontend.tokenizer import Tokenizer, TokenizerLoadError


def test_encode_gives_ids_and_character_offsets(tokenizer: Tokenizer) -> None:
    text = "Hello 你好 🎉"
    encoding = tokenizer.encode(text, add_special_tokens=False)
    assert len(encoding.offsets) == len(encoding.token_ids)
    assert encoding.offsets[0] == (0, 5)
    assert tokenizer.decode(encoding.token_ids) == text
    with_bos = tokenizer.encode(text, add_special_tokens=True).token_ids
    assert with_bos == [tokenizer.bos_token_id, *encoding.token_ids]


def test_decode_skips_special_tokens_on_request(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token_id is not None
    token_ids = [*tokenizer.encode("hi", add_special_tokens=False).token_ids, tokenizer.eos_token_id]
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == "hi"
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == "hi</s>"


def test_chat_template_renders_and_tokenizes_once(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.apply_chat_template([("system", "Be brief."), ("user", "Hi 🎉")])
    rendered = tokenizer.decode(token_ids, skip_special_tokens=False)
    assert rendered == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi 🎉<|end|>\n<|assistant|>\n"
    assert token_ids.count(0) == 1
    assert tokenizer.bos_token_id == 0


def test_missing_chat_template_is_a_request_error(tokenizer: Tokenizer, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        source = tokenizer.path / name
        if source.exists():
            text = source.read_text()
            if name == "tokenizer_config.json":
                import json

                config = json.loads(text)
                config.pop("chat_template", None)
                text = json.dumps(config)
            (tmp_path / name).write_text(text)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    plain = Tokenizer(tmp_path)
    assert not plain.has_chat_template
    with pytest.raises(RequestError, match="no chat template") as excinfo:
        plain.apply_chat_template([("user", "hi")])
    assert excinfo.value.field_name == "messages"


def test_missing_directory_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="cannot load a tokenizer"):
        Tokenizer(tmp_path / "nothing-here")
