"""Generate through a real server whose Llama model has a SentencePiece-style tokenizer (Metaspace spaces,
byte fallback; tests/metaspace_tokenizer.py): a client that joins the prompt and the completion gets exactly
decode(prompt + completion), streamed and not, for every one of n completions and with stop strings (issue
#37, item 5: the completion lost its leading space). The random weights sample byte tokens that do not form
characters too, which must not fail the request (DecodeStream raised on them, and the frontend then failed
every request in flight).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
from apiutil import CALL_TIMEOUT_S, completion_ids, completion_text, finish_reasons
from engine_proto.engine.v1 import generate_pb2, info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_server.frontend.tokenizer import Tokenizer
from grpclib.client import Channel
from metaspace_tokenizer import metaspace_model_dir
from serverproc import RunningServer, start_server

PROMPTS = ("The capital of France is", "Once upon a time, in a land far away,", "你好 🎉 emoji:", "x")
NUM_SAMPLES = 4
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return metaspace_model_dir(tiny_model_dir, tmp_path_factory.mktemp("metaspace-llama"))


@pytest.fixture(scope="module")
def metaspace_server(model_dir: Path) -> Iterator[RunningServer]:
    with start_server("--model", str(model_dir), "--in-process-engine") as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture
async def stub(metaspace_server: RunningServer) -> AsyncIterator[EngineServiceStub]:
    channel = Channel("127.0.0.1", metaspace_server.port)
    yield EngineServiceStub(channel)
    channel.close()


def _request(
    prompt: str, *, stream: bool, n: int = 1, seed: int | None = None, stop: Sequence[str] = (),
    skip_special_tokens: bool = True,
) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(text=prompt, stream=stream)
    if seed is None:
        request.sampling.temperature = 0.0
    else:
        request.sampling.seed = seed
    request.sampling.n = n
    request.stopping.max_tokens = MAX_TOKENS
    request.stopping.ignore_eos = True
    request.stopping.stop.extend(stop)
    request.output.skip_special_tokens = skip_special_tokens
    return request


def _check_joins(
    tokenizer: Tokenizer, prompt: str, responses: Sequence[generate_pb2.GenerateResponse], *, n: int,
    skip_special_tokens: bool = True,
) -> list[tuple[str, list[int]]]:
    """Each completion's text continues the prompt's exactly; returns (text, ids) per completion."""
    prompt_ids = tokenizer.encode(prompt).token_ids  # <s> first, as the server tokenizes text
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    if skip_special_tokens:
        assert prompt_text == prompt
    completions = []
    for index in range(n):
        text, ids = completion_text(responses, index), completion_ids(responses, index)
        assert len(ids) == MAX_TOKENS
        whole = tokenizer.decode(prompt_ids + ids, skip_special_tokens=skip_special_tokens)
        assert prompt_text + text == whole, (prompt, ids)
        completions.append((text, ids))
    return completions


@pytest.mark.parametrize("stream", [True, False])
async def test_prompt_and_completion_join_to_the_full_decode(
    stub: EngineServiceStub, tokenizer: Tokenizer, stream: bool
) -> None:
    num_spaced = 0
    for prompt in PROMPTS:
        greedy = await stub.Generate(_request(prompt, stream=stream), timeout=CALL_TIMEOUT_S)
        sampled = await stub.Generate(_request(prompt, stream=stream, n=NUM_SAMPLES, seed=7),
                                      timeout=CALL_TIMEOUT_S)
        joined = [*_check_joins(tokenizer, prompt, greedy, n=1),
                  *_check_joins(tokenizer, prompt, sampled, n=NUM_SAMPLES)]
        for text, ids in joined:  # a first token that starts a word keeps its space ("▁Paris" -> " Paris")
            if tokenizer.backend.id_to_token(ids[0]).startswith("▁"):
                num_spaced += 1
                assert text.startswith(" "), (prompt, ids)
    assert num_spaced > 0  # (the random model starts words often)


async def test_streamed_and_whole_texts_agree(stub: EngineServiceStub) -> None:
    for prompt in PROMPTS:
        streamed = await stub.Generate(_request(prompt, stream=True, n=2, seed=3), timeout=CALL_TIMEOUT_S)
        whole = await stub.Generate(_request(prompt, stream=False, n=2, seed=3), timeout=CALL_TIMEOUT_S)
        assert len(whole) == 1
        for index in range(2):
            assert completion_ids(streamed, index) == completion_ids(whole, index)
            assert completion_text(streamed, index) == completion_text(whole, index)


async def test_special_tokens_kept(stub: EngineServiceStub, tokenizer: Tokenizer) -> None:
    for prompt in PROMPTS:
        for stream in (True, False):
            request = _request(prompt, stream=stream, n=2, seed=11, skip_special_tokens=False)
            responses = await stub.Generate(request, timeout=CALL_TIMEOUT_S)
            _check_joins(tokenizer, prompt, responses, n=2, skip_special_tokens=False)


@pytest.mark.parametrize("stream", [True, False])
async def test_stop_strings_match_the_joined_text(
    stub: EngineServiceStub, tokenizer: Tokenizer, stream: bool
) -> None:
    num_stopped = 0
    for prompt in PROMPTS:
        free = await stub.Generate(_request(prompt, stream=True), timeout=CALL_TIMEOUT_S)
        (text, _), = _check_joins(tokenizer, prompt, free, n=1)
        # a stop string that starts with a space inside the text: matched only where the space is kept
        start = text.find(" ", 1)
        if start < 0 or "\ufffd" in text[start:start + 3]:
            continue
        stop = text[start:start + 3]
        responses = await stub.Generate(_request(prompt, stream=stream, stop=[stop]), timeout=CALL_TIMEOUT_S)
        assert completion_text(responses) == text[:text.find(stop)]
        assert finish_reasons(responses) == {0: generate_pb2.FINISH_REASON_STOP}
        final = next(c for r in responses for c in r.completions if c.finish_reason)
        assert final.stop_string == stop
        num_stopped += 1
    assert num_stopped > 0
    load = (await stub.GetLoad(info_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)).load
    assert load.num_total_kv_blocks > 0  # (the server is still serving)
