"""A SentencePiece-style tokenizer (Llama-2 / Mistral: BPE with byte fallback, Metaspace "▁" spaces), trained
locally on the tiny model's corpus in a fraction of a second, for the detokenization tests; and a model
directory that serves the tiny model's random weights with it.

Its vocabulary has the tiny model's size (1024) and special tokens at the same ids (<s> 0, </s> 1, <pad> 2,
the chat tokens 3-6), then the 256 byte-fallback tokens <0x00>..<0xFF> as ordinary vocabulary (7-262).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

# The decoders a SentencePiece model comes with: "metaspace" (tokenizers' Metaspace, what transformers writes
# today) and "llama2" (the Replace/ByteFallback/Fuse/Strip chain in Llama-2's and Mistral's tokenizer.json).
DECODERS = ("metaspace", "llama2")
BYTE_TOKENS = [f"<0x{byte:02X}>" for byte in range(256)]
VOCAB_SIZE = 1024


def build_metaspace_tokenizer(out_dir: Path, *, decoder: str = "metaspace") -> Path:
    """Trains it and saves it as a fast tokenizer (tokenizer.json, tokenizer_config.json) into `out_dir`."""
    from engine_server.models import tiny
    from engine_server.models.corpus import TRAINING_TEXT
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if decoder == "metaspace":
        tokenizer.decoder = decoders.Sequence([
            decoders.Metaspace(replacement="▁", prepend_scheme="first"), decoders.ByteFallback(),
            decoders.Fuse(),
        ])
    elif decoder == "llama2":
        tokenizer.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
        ])
    else:
        raise ValueError(f"decoder must be one of {DECODERS}, not {decoder!r}")
    # NOTE: the trainer numbers its special tokens first; the byte tokens go in that way, then become ordinary
    # vocabulary below (a byte-fallback model has them in its vocabulary, not as added tokens).
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[*tiny.SPECIAL_TOKENS, *BYTE_TOKENS], show_progress=False
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = [token for token in data["added_tokens"] if token["content"] not in BYTE_TOKENS]
    tokenizer = Tokenizer.from_str(json.dumps(data))
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tiny.BOS_TOKEN} $A", pair=f"{tiny.BOS_TOKEN} $A $B", special_tokens=[(tiny.BOS_TOKEN, 0)],
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, bos_token=tiny.BOS_TOKEN, eos_token=tiny.EOS_TOKEN,
        pad_token=tiny.PAD_TOKEN, additional_special_tokens=list(tiny.CHAT_TOKENS), model_max_length=2048,
    )
    fast.chat_template = tiny.CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def metaspace_model_dir(tiny_model_dir: Path, out_dir: Path, *, decoder: str = "metaspace") -> Path:
    """The tiny model's random weights and config (linked) with this tokenizer: a model the server serves."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        os.symlink(tiny_model_dir / name, out_dir / name)
    shutil.copy(tiny_model_dir / "README.md", out_dir / "README.md")
    return build_metaspace_tokenizer(out_dir, decoder=decoder)
