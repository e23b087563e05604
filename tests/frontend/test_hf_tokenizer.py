"""hf_tokenizer: the tokenizer AutoTokenizer would pick, loaded without torch when its choice is known."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from engine_server.frontend.hf_tokenizer import (
    GENERIC_TOKENIZER_CLASSES,
    MISTRAL_TOKENIZER_FILE,
    OVERRIDDEN_MODEL_TYPES,
    is_generic_fast_tokenizer,
    load_hf_tokenizer,
)

SUBPROCESS_TIMEOUT_S = 120.0
TEXTS = ("Hello 你好 🎉", "  two  spaces\nand a newline", "<s>special</s> in text")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def _copy_with(model_dir: Path, tmp_path: Path, *, tokenizer_config: dict[str, object] | None = None,
               config: dict[str, object] | None = None) -> Path:
    """The model's tokenizer files (and config.json) with some keys replaced."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, tmp_path / name)
    for name, changes in (("tokenizer_config.json", tokenizer_config), ("config.json", config)):
        data = json.loads((tmp_path / name).read_text())
        data.update(changes or {})
        (tmp_path / name).write_text(json.dumps(data))
    return tmp_path


def test_the_tiny_model_takes_the_torch_free_path(model_dir: Path) -> None:
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["tokenizer_class"] in (
        GENERIC_TOKENIZER_CLASSES
    )
    assert is_generic_fast_tokenizer(model_dir)


def test_loading_and_using_it_imports_no_torch(model_dir: Path) -> None:
    # NOTE: a fresh interpreter: the test process may hold torch already.
    script = (
        "import sys\n"
        "from engine_server.frontend.tokenizer import Tokenizer\n"
        f"tokenizer = Tokenizer({str(model_dir)!r})\n"
        "ids = tokenizer.apply_chat_template([('user', 'Hi')])\n"
        "assert tokenizer.decode(tokenizer.encode('Hello').token_ids) == 'Hello'\n"
        "print(len(ids), 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    num_ids, has_torch = result.stdout.split()
    assert int(num_ids) > 0
    assert has_torch == "False"


def test_it_is_what_auto_tokenizer_loads(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = load_hf_tokenizer(model_dir)
    auto = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert type(ours) is type(auto)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        auto.bos_token_id, auto.eos_token_id, auto.pad_token_id
    )
    assert ours.all_special_ids == auto.all_special_ids
    assert len(ours) == len(auto)
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert ours.apply_chat_template(CHAT, tokenize=False) == auto.apply_chat_template(CHAT, tokenize=False)


@pytest.mark.parametrize(
    ("tokenizer_config", "config"),
    [
        ({"tokenizer_class": "LlamaTokenizerFast"}, None),  # a model-specific class: AutoTokenizer's rules
        ({"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}}, None),  # remote code
        (None, {"model_type": "qwen2"}),  # AutoTokenizer overrides the hub's generic class
    ],
)
def test_anything_else_goes_through_auto_tokenizer(
    model_dir: Path,
    tmp_path: Path,
    tokenizer_config: dict[str, object] | None,
    config: dict[str, object] | None,
) -> None:
    assert not is_generic_fast_tokenizer(_copy_with(model_dir, tmp_path, tokenizer_config=tokenizer_config,
                                                    config=config))


def test_a_mistral_tokenizer_goes_through_auto_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    copy = _copy_with(model_dir, tmp_path)
    assert is_generic_fast_tokenizer(copy)
    (copy / MISTRAL_TOKENIZER_FILE).write_text("{}")
    assert not is_generic_fast_tokenizer(copy)


def test_a_directory_without_tokenizer_files_goes_through_auto_tokenizer(tmp_path: Path) -> None:
    assert not is_generic_fast_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("not json")
    assert not is_generic_fast_tokenizer(tmp_path)


def test_the_override_list_covers_this_transformers() -> None:
    # NOTE: transformers' private tables; if they move, re-check what AutoTokenizer does with a generic class.
    from transformers.models.auto import tokenization_auto

    # NOTE: a type registered to MistralCommonBackend takes its own branch (tekken.json, checked separately).
    generic = {"TokenizersBackend", "PreTrainedTokenizer", "PythonBackend", "MistralCommonBackend"}
    registered = tokenization_auto.TOKENIZER_MAPPING_NAMES
    overridden = {
        model_type
        for model_type in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        if (registered.get(model_type) or "TokenizersBackend").removesuffix("Fast") not in generic
    }
    assert overridden <= OVERRIDDEN_MODEL_TYPES
