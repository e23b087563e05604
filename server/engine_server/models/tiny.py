"""Builds the random-weight test models: a tiny Llama and a byte-level BPE tokenizer, both made locally.

Deterministic (fixed seed, fixed corpus) and fast (seconds). The weights are random: the
models produce fluent-looking nonsense, which is all the tests and benchmarks need. The tiny
model is also the server's embedded default model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine_server.models.corpus import TRAINING_TEXT

# Bump when anything below changes what gets written: cached builds are keyed by it.
BUILDER_VERSION = 1

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *CHAT_TOKENS)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """The shape of one random-weight Llama."""

    name: str
    vocab_size: int  # tokenizer vocabulary target (special tokens included)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    # Larger than HF's 0.02 so the random logits are peaked: greedy ties (which make
    # float-rounding differences flip tokens) become rare and outputs vary in length.
    initializer_range: float = 0.2
    seed: int = 0
    pad_vocab: bool = False
    dtype: str = "float32"  # of the saved weights (and so of the engine's "auto" dtype on cuda)
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


TINY = TinyModelSpec(
    name="tiny-llama", vocab_size=1024, hidden_size=64, intermediate_size=192,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
)
# About 30M parameters: the benchmark's "larger" model.
BENCH_30M = TinyModelSpec(
    name="bench-llama-30m", vocab_size=8192, hidden_size=512, intermediate_size=1408,
    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, initializer_range=0.05, pad_vocab=True,
)
# Llama-3.2-1B's shape (1.24B parameters, bfloat16): a model of realistic shape for GPU benchmarks, whose
# cost per token is a real model's. Not built by tests (2.5 GB); build it with scripts/build_test_models.py.
BENCH_1B = TinyModelSpec(
    name="bench-llama-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    initializer_range=0.02, pad_vocab=True, dtype="bfloat16", tie_word_embeddings=True,
)
# TINY with head_dim 32 (2 heads, 1 KV head; the same parameter count): vLLM's CPU attention supports head
# sizes >= 32 only, so bench/vllm_peer.py compares the engines on this one. Tests use TINY.
TINY_HD32 = TinyModelSpec(
    name="tiny-llama-hd32", vocab_size=1024, hidden_size=64, intermediate_size=192,
    num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
)
# SmolLM2-135M's shape (134.5M parameters: 30 layers, hidden 576, 9 heads / 3 KV heads of 64, vocabulary
# 49152, tied embeddings): a real model's shape that a 2-core CPU still serves, for bench/vllm_peer.py.
BENCH_135M = TinyModelSpec(
    name="bench-llama-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, initializer_range=0.05,
    pad_vocab=True, tie_word_embeddings=True,
)
SPECS = {spec.name: spec for spec in (TINY, BENCH_30M, BENCH_1B, TINY_HD32, BENCH_135M)}


def build_tokenizer(vocab_size: int, out_dir: Path) -> int:
    """Trains a byte-level BPE on the embedded corpus, saves it as a fast tokenizer; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # NOTE: every byte in the base vocabulary is what makes any UTF-8 text round-trip.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)],
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=list(CHAT_TOKENS), model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return int(tokenizer.get_vocab_size())


def build_model(spec: TinyModelSpec, out_dir: Path, *, device: str = "cpu") -> None:
    """Writes tokenizer + random-weight LlamaForCausalLM (safetensors) into out_dir; the weights are drawn on
    `device` (a GPU draws a billion-parameter model in a second; the CPU, with another random stream, in
    a minute)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    # A corpus this small may stop BPE short of its target; the model's vocabulary is padded up
    # to the target (as real models pad theirs), except for the tiny model, whose vocabulary
    # matches the tokenizer so every id it can sample decodes.
    num_tokenizer_ids = build_tokenizer(spec.vocab_size, out_dir)
    vocab_size = max(num_tokenizer_ids, spec.vocab_size) if spec.pad_vocab else num_tokenizer_ids
    bos_id, eos_id, pad_id = 0, 1, 2  # SPECIAL_TOKENS order: the trainer numbers them first
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range, bos_token_id=bos_id, eos_token_id=eos_id,
        pad_token_id=pad_id, tie_word_embeddings=spec.tie_word_embeddings, rms_norm_eps=1e-5,
    )
    torch.manual_seed(spec.seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "README.md").write_text(
        f"# {spec.name}\n\nRANDOM WEIGHTS, FOR TESTING ONLY. Built by engine_server.models.tiny "
        f"(builder version {BUILDER_VERSION}, seed {spec.seed}); its output is meaningless.\n"
    )
    marker = {"builder": "engine_server.models.tiny", "builder_version": BUILDER_VERSION,
              "spec": spec.name, "weights": "random weights, for testing"}
    (out_dir / "engine_test_model.json").write_text(json.dumps(marker, indent=2) + "\n")


def cache_root() -> Path:
    env = os.environ.get("ENGINE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "engine-server"


def cached_model_dir(spec_name: str = TINY.name) -> Path:
    """Builds the named test model once into the cache dir (atomically) and returns its directory."""
    spec = SPECS[spec_name]
    final = cache_root() / f"{spec.name}-v{BUILDER_VERSION}"
    if (final / "engine_test_model.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the destination and rename: a reader never sees a half-written model,
    # and two concurrent builders both succeed (the loser's copy is dropped).
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=final.parent))
    try:
        build_model(spec, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "engine_test_model.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def default_model_dir() -> Path:
    """The tiny test model, built on first use."""
    return cached_model_dir(TINY.name)
