"""The test-model builder: deterministic, UTF-8 round-trips, chat template, marked as random weights."""

from __future__ import annotations

import json
from pathlib import Path

from engine_server.models.tiny import (
    BENCH_1B,
    TINY,
    TinyModelSpec,
    build_model,
    build_tokenizer,
    default_model_dir,
)


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


def test_a_spec_sets_the_saved_dtype_and_tied_embeddings(tmp_path: Path) -> None:
    from safetensors import safe_open

    spec = TinyModelSpec(name="t", vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, pad_vocab=True, dtype="bfloat16",
                         tie_word_embeddings=True)
    build_model(spec, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] >= 400
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
        assert {str(weights.get_tensor(n).dtype) for n in names} == {"torch.bfloat16"}
    assert "lm_head.weight" not in names  # tied: the embedding serves as the head


def test_the_1b_benchmark_spec_has_llama_3_2_1b_parameter_count() -> None:
    s = BENCH_1B
    head_dim = s.hidden_size // s.num_attention_heads
    attention = s.hidden_size * head_dim * (2 * s.num_attention_heads + 2 * s.num_key_value_heads)
    mlp = 3 * s.hidden_size * s.intermediate_size
    per_layer = attention + mlp + 2 * s.hidden_size
    total = s.vocab_size * s.hidden_size + s.num_hidden_layers * per_layer + s.hidden_size  # tied head
    assert 1.23e9 < total < 1.24e9  # Llama-3.2-1B: 1,235,814,400
