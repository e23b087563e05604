"""The two Python flavours of engine.v1 speak the same wire format (required by issues 2 and 5).

A message serialized by the betterproto2 dataclasses parses with the upb ``_pb2`` classes and vice versa,
for a request that exercises a oneof, proto3 ``optional`` fields set to their zero value (temperature=0.0
must stay SET: it means greedy), a map and repeated fields; and for a streamed response with enums and a
nested oneof.
"""

from __future__ import annotations

import betterproto2
from engine_client import dataclasses as bp
from engine_proto.engine.v1 import generate_pb2


def _betterproto_request() -> bp.GenerateRequest:
    return bp.GenerateRequest(
        request_id="req-1",
        chat=bp.ChatMessages(messages=[bp.ChatMessage(role="user", content="héllo ✓")],
                             add_generation_prompt=False),
        sampling=bp.SamplingParams(temperature=0.0, top_k=0, seed=2**63 + 5, logit_bias={7: -1.5, 900: 2.0},
                                   n=3),
        stopping=bp.StoppingCriteria(max_tokens=16, stop=["\n", "END"], stop_token_ids=[1, 2]),
        output=bp.OutputOptions(logprobs=0),
        stream=True,
        add_special_tokens=False,
    )


def _pb2_request() -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(request_id="req-1", stream=True, add_special_tokens=False)
    req.chat.messages.add(role="user", content="héllo ✓")
    req.chat.add_generation_prompt = False
    req.sampling.temperature = 0.0
    req.sampling.top_k = 0
    req.sampling.seed = 2**63 + 5
    req.sampling.logit_bias.update({7: -1.5, 900: 2.0})
    req.sampling.n = 3
    req.stopping.max_tokens = 16
    req.stopping.stop.extend(["\n", "END"])
    req.stopping.stop_token_ids.extend([1, 2])
    req.output.logprobs = 0
    return req


def test_betterproto_request_parses_with_pb2() -> None:
    parsed = generate_pb2.GenerateRequest.FromString(bytes(_betterproto_request()))
    assert parsed == _pb2_request()
    assert parsed.WhichOneof("input") == "chat"
    # proto3 `optional` zero values survive as SET (the greedy / "off" meaning is not lost)
    assert parsed.sampling.HasField("temperature")
    assert parsed.sampling.HasField("top_k")
    assert parsed.output.HasField("logprobs")
    assert parsed.HasField("add_special_tokens")
    assert not parsed.sampling.HasField("top_p")
    assert dict(parsed.sampling.logit_bias) == {7: -1.5, 900: 2.0}


def test_pb2_request_parses_with_betterproto() -> None:
    parsed = bp.GenerateRequest.parse(_pb2_request().SerializeToString())
    assert parsed == _betterproto_request()
    assert betterproto2.which_one_of(parsed, "input")[0] == "chat"
    assert parsed.sampling is not None
    assert parsed.sampling.temperature == 0.0
    assert parsed.sampling.top_p is None


def _pb2_response() -> generate_pb2.GenerateResponse:
    resp = generate_pb2.GenerateResponse(request_id="req-1")
    chunk = resp.completions.add(index=1, token_ids=[5, 6], text="ab", stop_string="END",
                                 finish_reason=generate_pb2.FINISH_REASON_STOP)
    chunk.logprobs.add(token_id=5, logprob=-0.5, rank=1).top.add(token_id=5, logprob=-0.5)
    resp.completions.add(index=0, token_ids=[9], stop_token_id=1,
                         finish_reason=generate_pb2.FINISH_REASON_STOP)
    resp.usage.prompt_tokens = 4
    resp.usage.completion_tokens = 3
    return resp


def _betterproto_response() -> bp.GenerateResponse:
    return bp.GenerateResponse(
        request_id="req-1",
        completions=[
            bp.CompletionChunk(index=1, token_ids=[5, 6], text="ab", stop_string="END",
                               finish_reason=bp.FinishReason.STOP,
                               logprobs=[bp.TokenLogprob(token_id=5, logprob=-0.5, rank=1,
                                                         top=[bp.TopLogprob(token_id=5, logprob=-0.5)])]),
            bp.CompletionChunk(index=0, token_ids=[9], stop_token_id=1, finish_reason=bp.FinishReason.STOP),
        ],
        usage=bp.Usage(prompt_tokens=4, completion_tokens=3),
    )


def test_response_round_trips_both_ways() -> None:
    assert generate_pb2.GenerateResponse.FromString(bytes(_betterproto_response())) == _pb2_response()
    parsed = bp.GenerateResponse.parse(_pb2_response().SerializeToString())
    assert parsed == _betterproto_response()
    assert betterproto2.which_one_of(parsed.completions[1], "matched_stop") == ("stop_token_id", 1)
