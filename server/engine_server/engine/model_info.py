"""`ModelInfo`: what the frontend and the API layer know about the loaded model.

NOTE: plain data, no torch: the frontend processes import it, and they never load torch (seconds of start-up
and hundreds of MB each, times `--api-workers`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Sent by the core once its model is loaded; the frontend validates requests and answers GetModelInfo."""

    model_path: str
    architecture: str
    task: str  # "generate" | "embed"
    max_model_len: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    dtype: str
    device: str
    embedding_dim: int | None
    num_parameters: int
    num_kv_blocks: int
    block_size: int
