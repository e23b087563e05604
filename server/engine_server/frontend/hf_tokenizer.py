"""Loads a model directory's Hugging Face tokenizer, without torch whenever AutoTokenizer's choice is known.

`transformers.AutoTokenizer` imports torch (its config classes do, through `modeling_rope_utils`) before it
looks at a file: seconds of start-up and hundreds of MB in every frontend process. Most directories name a
generic fast tokenizer in `tokenizer_config.json`, and for those AutoTokenizer returns a `TokenizersBackend`
(= `PreTrainedTokenizerFast`), which we can load directly, torch-free. Anything else goes through
AutoTokenizer, torch and all, so that the tokenizer is always the one AutoTokenizer would pick.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# NOTE: the classes that AutoTokenizer (transformers 5) loads as TokenizersBackend when tokenizer_config.json
# names one.
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})

# NOTE: model types whose generic hub class AutoTokenizer replaces with a model-specific one (transformers'
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, the entries registered to a class of their own); these take the
# AutoTokenizer path. tests/frontend/test_hf_tokenizer.py fails when an upgrade of transformers adds one.
OVERRIDDEN_MODEL_TYPES = frozenset({
    "hyperclovax_vision_v2", "qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "siglip2",
})

MISTRAL_TOKENIZER_FILE = "tekken.json"


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # unreadable: AutoTokenizer decides (and reports the problem)
    return data if isinstance(data, dict) else {}


def is_generic_fast_tokenizer(path: Path) -> bool:
    """True when AutoTokenizer would load `path` as a plain TokenizersBackend (no remote code or override)."""
    tokenizer_config = _read_json_object(path / "tokenizer_config.json")
    declared = tokenizer_config.get("tokenizer_class")
    if declared not in GENERIC_TOKENIZER_CLASSES or "auto_map" in tokenizer_config:
        return False
    if (path / MISTRAL_TOKENIZER_FILE).exists():
        return False  # AutoTokenizer may pick MistralCommonBackend (when mistral-common is installed)
    model_type = _read_json_object(path / "config.json").get("model_type")
    return model_type not in OVERRIDDEN_MODEL_TYPES


def load_hf_tokenizer(path: Path) -> Any:
    """The tokenizer AutoTokenizer would load from `path`; raises what `from_pretrained` raises."""
    if is_generic_fast_tokenizer(path):
        from transformers import PreTrainedTokenizerFast  # NOTE: torch-free, unlike AutoTokenizer

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
