"""Adapters the engine refuses (issue 41): each a clear AdapterError subclass, nothing loaded, the engine
serving as before."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.lora.errors import (
    AdapterError,
    AdapterFormatError,
    AdapterIncompatible,
    AdapterPathError,
    AdapterRankTooLarge,
)
from engine_server.engine.lora.loader import CONFIG_FILE, WEIGHTS_FILE
from engine_server.engine.types import EngineRequest, SamplingParams
from engine_testutil import engine_config, run
from lora_testutil import AdapterSpec, build_adapter
from safetensors.torch import load_file, save_file

GOOD = AdapterSpec("good", 8, ("q_proj", "v_proj", "down_proj"), lora_alpha=16, seed=7)
PROMPT = (5, 6, 7, 8, 9, 10, 11)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> tuple[Path, Path]:
    """(the adapter directory holding "good", a directory outside it holding a copy of "good")."""
    root = tmp_path_factory.mktemp("adapter-dir")
    build_adapter(model_dir, root, GOOD)
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(root / GOOD.name, outside / GOOD.name)
    return root, outside


@pytest.fixture(scope="module")
def engine(model_dir: Path, dirs: tuple[Path, Path]) -> LLMEngine:
    return LLMEngine(engine_config(model_dir, num_kv_blocks=64, max_adapters=2, max_lora_rank=8,
                                   adapter_dir=str(dirs[0])))


def _variant(root: Path, name: str, change: Callable[[Path], None]) -> str:
    """A copy of the good adapter under `name`, changed; returns its path relative to the root."""
    path = root / name
    if not path.exists():
        shutil.copytree(root / GOOD.name, path)
        change(path)
    return name


def _edit_config(**changes: object) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        config = json.loads((path / CONFIG_FILE).read_text())
        config.update(changes)
        (path / CONFIG_FILE).write_text(json.dumps(config))
    return change


def _edit_tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        tensors = load_file(str(path / WEIGHTS_FILE))
        change(tensors)
        save_file(tensors, str(path / WEIGHTS_FILE))
    return edit


def _rename_first(new: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        key = next(k for k in sorted(tensors) if "model.layers.0.self_attn.q_proj.lora_A" in k)
        tensors[key.replace("model.layers.0.self_attn.q_proj", new)] = tensors.pop(key)
    return change


def _poison(tensors: dict[str, torch.Tensor]) -> None:
    tensors[sorted(tensors)[0]][0, 0] = float("nan")


def _widen(tensors: dict[str, torch.Tensor]) -> None:
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        (path / name).write_bytes(data)
    return change


def _remove(name: str) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        (path / name).unlink()
    return change


def _truncate(path: Path) -> None:
    data = (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes(data[:len(data) // 2])


BAD: list[tuple[str, Callable[[Path], None], type[AdapterError], str]] = [
    ("no-config", _remove(CONFIG_FILE), AdapterFormatError, "has no adapter_config.json"),
    ("config-not-json", _write(CONFIG_FILE, b"{not json"), AdapterFormatError, "not readable JSON"),
    ("config-a-list", _write(CONFIG_FILE, b"[1, 2]"), AdapterFormatError, "not a JSON object"),
    ("not-lora", _edit_config(peft_type="IA3"), AdapterFormatError, "is not LORA"),
    ("dora", _edit_config(use_dora=True), AdapterFormatError, "use_dora"),
    ("rank-pattern", _edit_config(rank_pattern={"q_proj": 4}), AdapterFormatError, "rank_pattern"),
    ("bad-rank", _edit_config(r="eight"), AdapterFormatError, "r must be"),
    ("rank-too-large", _edit_config(r=32), AdapterRankTooLarge, "max_lora_rank is 8"),
    ("no-weights", _remove(WEIGHTS_FILE), AdapterFormatError, "has no adapter_model.safetensors"),
    ("garbage-weights", _write(WEIGHTS_FILE, b"\x00" * 64), AdapterFormatError, "not a readable safetensors"),
    ("truncated-weights", _truncate, AdapterFormatError, "not a readable safetensors"),
    ("unknown-layer", _edit_tensors(_rename_first("model.layers.99.self_attn.q_proj")), AdapterIncompatible,
     "does not have"),
    ("embedding", _edit_tensors(_rename_first("model.embed_tokens")), AdapterIncompatible, "adaptable"),
    ("wrong-shape", _edit_tensors(_widen), AdapterIncompatible, "needs"),
    ("nan", _edit_tensors(_poison), AdapterFormatError, "not all finite"),
]


@pytest.mark.parametrize(("name", "change", "error", "message"), BAD, ids=[case[0] for case in BAD])
def test_bad_adapter_is_refused_with_nothing_loaded(engine: LLMEngine, dirs: tuple[Path, Path], name: str,
                                                    change: Callable[[Path], None], error: type[AdapterError],
                                                    message: str) -> None:
    with pytest.raises(error, match=message):
        engine.load_adapter(name, _variant(dirs[0], name, change))
    _assert_unaffected(engine)


def _assert_unaffected(engine: LLMEngine) -> None:
    assert engine.list_adapters() == []
    params = SamplingParams(temperature=0.0, max_tokens=3)
    out = run(engine, [EngineRequest("after", PROMPT, params)])
    assert len(out.tokens[("after", 0)]) == 3


def test_paths_outside_the_adapter_directory_are_refused(engine: LLMEngine, dirs: tuple[Path, Path]) -> None:
    root, outside = dirs
    (root / "link-out").symlink_to(outside / GOOD.name)  # a directory symlink leading out
    linked_file = root / "file-link-out"
    shutil.copytree(root / GOOD.name, linked_file)
    (linked_file / WEIGHTS_FILE).unlink()
    (linked_file / WEIGHTS_FILE).symlink_to(outside / GOOD.name / WEIGHTS_FILE)  # one file leading out
    for path in ("../" + outside.name + "/" + GOOD.name, str(outside / GOOD.name), "link-out",
                 "file-link-out", "good/../../" + outside.name + "/good"):
        with pytest.raises(AdapterPathError, match="outside the server's adapter directory"):
            engine.load_adapter("escape", path)
    for path, why in (("missing", "does not exist"), ("", "required"), (f"{GOOD.name}/{CONFIG_FILE}",
                                                                        "not a directory")):
        with pytest.raises(AdapterPathError, match=why):
            engine.load_adapter("escape", path)
    _assert_unaffected(engine)
    # inside the directory, relative or absolute, is fine
    assert engine.load_adapter("ok-relative", GOOD.name).rank == 8
    assert engine.load_adapter("ok-absolute", str(root / GOOD.name)).rank == 8
    engine.unload_adapter("ok-relative")
    engine.unload_adapter("ok-absolute")


def test_names_and_run_time_loading_switch(engine: LLMEngine, model_dir: Path,
                                           dirs: tuple[Path, Path]) -> None:
    for name in ("", " padded", "x" * 129, "tab\there"):
        with pytest.raises(AdapterError, match="adapter name"):
            engine.load_adapter(name, GOOD.name)
    no_dir = LLMEngine(engine_config(model_dir, num_kv_blocks=16, max_adapters=1))
    with pytest.raises(AdapterError, match="run time is off"):
        no_dir.load_adapter("good", str(dirs[0] / GOOD.name))
    no_lora = LLMEngine(engine_config(model_dir, num_kv_blocks=16))
    with pytest.raises(AdapterError, match="no LoRA adapters"):
        no_lora.load_adapter("good", str(dirs[0] / GOOD.name))
    _assert_unaffected(engine)
