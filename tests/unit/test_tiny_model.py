"""The test-model builder: deterministic, UTF-8 round-trips, chat template, marked as random weights."""

from __future__ import annotations

import json
from pathlib import Path

from engine_server.models.tiny import TINY, build_tokenizer, default_model_dir


def test_cached_tiny_model_is_complete_and_marked() -> None:
    model_dir = default_model_dir()
    assert default_model_dir() == model_dir  # built once
    marker = json.loads((model_dir / "engine_test_model.json").read_text())
    assert marker["weights"] == "random weights, for testing"
    assert "RANDOM WEIGHTS" in (model_dir / "README.md").read_text()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["max_position_embeddings"] == 2048
    assert (model_dir / "model.safetensors").is_file()


def test_tokenizer_round_trips_any_utf8_and_renders_the_chat_template() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()), local_files_only=True)
    text = "héllo wörld — 日本語 🙂🚀 \x00\t\n tabs\tand  spaces, Ελληνικά"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    assert max(ids) < len(tok)
    assert tok(text).input_ids[0] == tok.bos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"
    assert tok.eos_token_id == 1


def test_tokenizer_training_is_deterministic(tmp_path: Path) -> None:
    sizes = [build_tokenizer(TINY.vocab_size, tmp_path / name) for name in ("a", "b")]
    assert sizes[0] == sizes[1] == TINY.vocab_size
    first, second = ((tmp_path / name / "tokenizer.json").read_bytes() for name in ("a", "b"))
    assert first == second
