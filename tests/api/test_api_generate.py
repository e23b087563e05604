"""Generate through a real server (subprocess, tiny model) and the real grpclib client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from apiutil import (
    CALL_TIMEOUT_S,
    completion_ids,
    completion_text,
    finish_reasons,
    greedy_request,
)
from engine_proto.engine.v1 import generate_pb2, tokenize_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub

PROMPTS = ("The quick brown fox", "Once upon a time, in a land far away,")


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return model.eval()


def _reference(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=model.config.eos_token_id,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_generate_equals_transformers(
    stub: EngineServiceStub, hf_model: Any, prompt: str
) -> None:
    tokenized = await stub.Tokenize(tokenize_pb2.TokenizeRequest(text=prompt), timeout=CALL_TIMEOUT_S)
    prompt_ids = list(tokenized.token_ids)
    responses = await stub.Generate(greedy_request(prompt_ids, max_tokens=12), timeout=CALL_TIMEOUT_S)
    expected = _reference(hf_model, prompt_ids, 12)
    assert completion_ids(responses) == expected
    # The text input path tokenizes the same way (BOS added by default).
    by_text = await stub.Generate(greedy_request(text=prompt, max_tokens=12), timeout=CALL_TIMEOUT_S)
    assert completion_ids(by_text) == expected


async def test_streaming_and_unary_agree(stub: EngineServiceStub) -> None:
    streamed = await stub.Generate(greedy_request(text=PROMPTS[1], max_tokens=12), timeout=CALL_TIMEOUT_S)
    whole = await stub.Generate(
        greedy_request(text=PROMPTS[1], max_tokens=12, stream=False), timeout=CALL_TIMEOUT_S
    )
    assert len(whole) == 1
    assert completion_ids(streamed) == completion_ids(whole)
    assert completion_text(streamed) == completion_text(whole)
    assert finish_reasons(streamed) == finish_reasons(whole)
    assert streamed[-1].usage == whole[0].usage
    assert whole[0].usage.completion_tokens == len(completion_ids(whole))


async def test_stream_shape(stub: EngineServiceStub) -> None:
    responses = await stub.Generate(
        greedy_request(text="abc", max_tokens=12, ignore_eos=True), timeout=CALL_TIMEOUT_S
    )
    request_ids = {r.request_id for r in responses}
    assert len(request_ids) == 1
    assert len(request_ids.pop()) == 32  # assigned by the server: uuid4 hex
    assert len(completion_ids(responses)) == 12
    assert [r.HasField("usage") for r in responses] == [False] * (len(responses) - 1) + [True]
    finished = [c for r in responses for c in r.completions if c.finish_reason]
    assert len(finished) == 1
    assert finished[0].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert responses[-1].completions[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage.prompt_tokens == 4
    assert responses[-1].usage.completion_tokens == 12


async def test_client_request_id_is_echoed(stub: EngineServiceStub) -> None:
    responses = await stub.Generate(
        greedy_request(text="x", max_tokens=3, request_id="my-id-1"), timeout=CALL_TIMEOUT_S
    )
    assert {r.request_id for r in responses} == {"my-id-1"}


async def test_n_completions_each_finish_once(stub: EngineServiceStub) -> None:
    request = greedy_request(text=PROMPTS[0], max_tokens=8, ignore_eos=True)
    request.sampling.temperature = 1.0
    request.sampling.seed = 7
    request.sampling.n = 3
    responses = await stub.Generate(request, timeout=CALL_TIMEOUT_S)
    assert finish_reasons(responses) == {i: generate_pb2.FINISH_REASON_LENGTH for i in range(3)}
    assert all(len(completion_ids(responses, i)) == 8 for i in range(3))
    assert responses[-1].usage.completion_tokens == 24
    # Seeded: the same request gives the same tokens.
    again = await stub.Generate(request, timeout=CALL_TIMEOUT_S)
    assert [completion_ids(again, i) for i in range(3)] == [completion_ids(responses, i) for i in range(3)]


async def test_stop_string_cuts_the_text(stub: EngineServiceStub) -> None:
    free = await stub.Generate(
        greedy_request(text=PROMPTS[0], max_tokens=24, ignore_eos=True), timeout=CALL_TIMEOUT_S
    )
    text = completion_text(free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    request = greedy_request(text=PROMPTS[0], max_tokens=24, ignore_eos=True)
    request.stopping.stop.append(stop)
    stopped = await stub.Generate(request, timeout=CALL_TIMEOUT_S)
    last = next(c for r in stopped for c in r.completions if c.finish_reason)
    assert last.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert last.WhichOneof("matched_stop") == "stop_string"
    assert last.stop_string == stop
    assert completion_text(stopped) == text[: text.index(stop)]


async def test_logprobs_and_prompt_logprobs(stub: EngineServiceStub) -> None:
    request = greedy_request(text=PROMPTS[0], max_tokens=5, ignore_eos=True)
    request.output.logprobs = 2
    request.output.prompt_logprobs = 1
    responses = await stub.Generate(request, timeout=CALL_TIMEOUT_S)
    chunks = [c for r in responses for c in r.completions]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == completion_ids(responses)
    assert all(lp.rank == 1 and len(lp.top) == 2 and lp.top[0].token_id == lp.token_id for lp in logprobs)
    prompt_tokens = responses[-1].usage.prompt_tokens
    assert len(responses[0].prompt_logprobs) == prompt_tokens - 1
    assert all(not r.prompt_logprobs for r in responses[1:])


async def test_chat_input_uses_the_template(stub: EngineServiceStub) -> None:
    chat = generate_pb2.ChatMessages()
    chat.messages.add(role="system", content="Be brief.")
    chat.messages.add(role="user", content="Hello!")
    tokenized = await stub.Tokenize(tokenize_pb2.TokenizeRequest(chat=chat), timeout=CALL_TIMEOUT_S)
    request = generate_pb2.GenerateRequest(chat=chat, stream=True)
    request.stopping.max_tokens = 4
    responses = await stub.Generate(request, timeout=CALL_TIMEOUT_S)
    assert responses[-1].usage.prompt_tokens == len(tokenized.token_ids)
    by_ids = await stub.Generate(
        greedy_request(list(tokenized.token_ids), max_tokens=4), timeout=CALL_TIMEOUT_S
    )
    request.sampling.temperature = 0.0
    by_chat = await stub.Generate(request, timeout=CALL_TIMEOUT_S)
    assert completion_ids(by_chat) == completion_ids(by_ids)
