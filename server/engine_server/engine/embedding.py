"""Embedding models (e.g. sentence-transformers MiniLM): encoder forward, the model's pooling, L2 norm.

The pooling mode comes from the sentence-transformers layout when present (modules.json ->
the Pooling module's config.json); mean pooling over non-padding tokens otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_server.engine.loader import read_json
from engine_server.engine.types import RequestError

POOLING_MODES = ("mean", "cls", "max", "lasttoken")
MAX_EMBED_BATCH = 64  # inputs per forward pass; longer lists are split


def read_pooling_mode(model_dir: Path) -> str:
    path = model_dir / "modules.json"
    modules: Any = None
    if path.is_file():
        with path.open(encoding="utf-8") as f:
            modules = json.load(f)
    for module in modules if isinstance(modules, list) else []:
        if str(module.get("type", "")).endswith("Pooling"):
            cfg = read_json(model_dir / str(module.get("path", "")) / "config.json")
            if cfg.get("pooling_mode_cls_token"):
                return "cls"
            if cfg.get("pooling_mode_max_tokens"):
                return "max"
            if cfg.get("pooling_mode_lasttoken"):
                return "lasttoken"
            return "mean"
    return "mean"


def sentence_max_seq_length(model_dir: Path) -> int | None:
    value = read_json(model_dir / "sentence_bert_config.json").get("max_seq_length")
    return int(value) if isinstance(value, int) else None


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [batch, len, dim], mask [batch, len] (1 = token) -> [batch, dim]."""
    m = mask.to(hidden.dtype)[:, :, None]
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(m == 0, float("-inf")).max(dim=1).values
    if mode == "lasttoken":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


@dataclass(slots=True)
class Embedder:
    model: torch.nn.Module
    dim: int
    pooling: str
    max_model_len: int
    vocab_size: int
    pad_token_id: int
    device: torch.device
    accepts_token_type_ids: bool

    @classmethod
    def load(cls, model_dir: Path, *, dtype: torch.dtype, device: torch.device,
             max_model_len: int) -> Embedder:
        from transformers import AutoModel

        model: Any = AutoModel.from_pretrained(str(model_dir), local_files_only=True, dtype=dtype)
        model = model.to(device).eval()
        config = model.config
        sbert_len = sentence_max_seq_length(model_dir)
        limit = min(max_model_len, sbert_len) if sbert_len else max_model_len
        type_vocab = getattr(config, "type_vocab_size", 0) or 0
        return cls(model=model, dim=int(config.hidden_size), pooling=read_pooling_mode(model_dir),
                   max_model_len=limit, vocab_size=int(config.vocab_size),
                   pad_token_id=int(getattr(config, "pad_token_id", None) or 0), device=device,
                   accepts_token_type_ids=type_vocab > 0)

    def validate(self, inputs: list[list[int]]) -> None:
        if not inputs:
            raise RequestError("input", "must contain at least one input")
        for i, ids in enumerate(inputs):
            if not ids:
                raise RequestError(f"input[{i}]", "must not be empty")
            if len(ids) > self.max_model_len:
                raise RequestError(f"input[{i}]", f"has {len(ids)} tokens; the model allows "
                                   f"{self.max_model_len}")
            for token_id in ids:
                if isinstance(token_id, bool) or not isinstance(token_id, int) \
                        or not 0 <= token_id < self.vocab_size:
                    raise RequestError(f"input[{i}]", f"token id {token_id!r} is outside the vocabulary "
                                       f"[0, {self.vocab_size})")

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]], *, normalize: bool) -> list[list[float]]:
        self.validate(inputs)
        out: list[list[float]] = []
        for start in range(0, len(inputs), MAX_EMBED_BATCH):
            batch = inputs[start:start + MAX_EMBED_BATCH]
            width = max(len(ids) for ids in batch)
            ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, token_ids in enumerate(batch):
                ids[row, :len(token_ids)] = torch.tensor(token_ids, dtype=torch.long)
                mask[row, :len(token_ids)] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            kwargs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask}
            if self.accepts_token_type_ids:
                kwargs["token_type_ids"] = torch.zeros_like(ids)
            hidden = self.model(**kwargs).last_hidden_state
            vectors = pool(hidden.float(), mask, self.pooling)
            if normalize:
                vectors = torch.nn.functional.normalize(vectors, p=2.0, dim=1)
            out.extend(vectors.cpu().tolist())
        return out
