"""Other transformers architectures through the paged attention: greedy output equals generate()."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_server.engine.config import EngineConfig
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, SamplingParams
from engine_testutil import run


def _build(name: str, out_dir: Path) -> None:
    import transformers as tf

    common: dict[str, Any] = {"vocab_size": 512, "initializer_range": 0.2}
    llama_like: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "max_position_embeddings": 512, **common}
    gpt2: dict[str, Any] = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512, **common}
    models: dict[str, Any] = {
        # attention biases
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(num_key_value_heads=2, **llama_like)),
        # absolute position embeddings, no rotary, fused qkv projection
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(**gpt2)),
        # multi-query attention (one KV head), explicit head_dim
        "gemma": (tf.GemmaForCausalLM, tf.GemmaConfig(num_key_value_heads=1, head_dim=16, **llama_like)),
        # a sliding window much shorter than the prompts (prefill chunks and decodes both windowed)
        "mistral-window": (tf.MistralForCausalLM, tf.MistralConfig(num_key_value_heads=2, sliding_window=8,
                                                                   **llama_like)),
    }
    cls, config = models[name]
    torch.manual_seed(0)
    cls(config).save_pretrained(str(out_dir))


@pytest.mark.parametrize("name", ["qwen2", "gpt2", "gemma", "mistral-window"])
def test_greedy_matches_generate(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    _build(name, tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=64, max_num_batched_tokens=32))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 50))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = run(engine, [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(prompts)], per_step=2)
    ref: Any = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="sdpa")
    ref.eval()
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            # min_new_tokens: like ignore_eos, the reference never stops early
            want = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, min_new_tokens=10,
                                pad_token_id=0)[0, len(prompt):].tolist()
        assert got.tokens[(f"r{i}", 0)] == want, f"{name} request {i}"
