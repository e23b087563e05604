"""Other transformers architectures through the paged attention: greedy output equals generate()."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, SamplingParams
from engine_testutil import DEVICE, engine_config, run


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
        # attention logit soft-capping, alternating sliding-window (8) and full layers, grouped-query
        # attention. The cap (2.0) is about the random weights' attention logits, so it changes the outputs;
        # untied: with the (sqrt(hidden)-scaled) input embeddings as the head, every output repeats its input.
        "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config(
            num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
            attn_logit_softcapping=2.0, final_logit_softcapping=5.0, tie_word_embeddings=False,
            **llama_like)),
    }
    cls, config = models[name]
    torch.manual_seed(0)
    cls(config).save_pretrained(str(out_dir))


@torch.inference_mode()
def _reference(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    # min_new_tokens: like ignore_eos, the reference never stops early
    return [model.generate(torch.tensor([prompt], device=model.device), do_sample=False,
                           max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           pad_token_id=0)[0, len(prompt):].tolist()
            for prompt in prompts]


@pytest.mark.parametrize("name", ["qwen2", "gpt2", "gemma", "mistral-window", "gemma2"])
def test_greedy_matches_generate(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    _build(name, tmp_path)
    engine = LLMEngine(engine_config(tmp_path, num_kv_blocks=64, max_num_batched_tokens=32))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 50))] for _ in range(6)]
    # A prompt longer than the step's token budget first (a chunked prefill), and one sharing its first two
    # blocks last (admitted steps later: a prefix-cache hit).
    prompts.insert(0, [rng.randrange(3, 500) for _ in range(40)])
    prompts.append(prompts[0][:32] + [rng.randrange(3, 500) for _ in range(5)])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = run(engine, [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(prompts)], per_step=2)
    assert engine.stats().num_prefix_cache_hit_tokens >= 32
    # Gemma2's soft-capping exists in transformers' eager attention only (its sdpa path has none).
    implementation = "eager" if name == "gemma2" else "sdpa"
    ref: Any = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation=implementation)
    ref.to(DEVICE).eval()
    want = _reference(ref, prompts, 10)
    for i in range(len(prompts)):
        assert got.tokens[(f"r{i}", 0)] == want[i], f"{name} request {i}"
    if name == "gemma2":  # the cap must change these outputs, or the test above proves nothing about it
        for layer in ref.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        assert _reference(ref, prompts, 10) != want
