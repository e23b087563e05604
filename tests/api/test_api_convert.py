"""The protobuf -> engine conversion on its own: the contract's defaults for unset fields, and field names."""

from __future__ import annotations

import pytest
from engine_proto.engine.v1 import generate_pb2, tokenize_pb2
from engine_server.api import convert
from engine_server.api.errors import to_grpc_error
from engine_server.engine.types import EngineDead, EngineOverloaded, RequestError
from engine_server.frontend.outputs import GenerateRequest
from fakes import BOS, FakeEngine, FakeTokenizer

INFO = FakeEngine().model_info
TOKENIZER = FakeTokenizer()


def _convert(request: generate_pb2.GenerateRequest) -> GenerateRequest:
    return convert.to_generate_request(request, tokenizer=TOKENIZER, model_info=INFO)


def test_unset_fields_take_the_documented_defaults() -> None:
    converted = _convert(generate_pb2.GenerateRequest(text="ab"))
    params = converted.params
    assert params.temperature == 1.0  # unset: 1.0; an explicit 0 means greedy
    assert (params.top_p, params.top_k, params.min_p, params.n) == (1.0, 0, 0.0, 1)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (params.seed, params.max_tokens, params.logprobs, params.prompt_logprobs) == (
        None,
        None,
        None,
        None,
    )
    assert converted.prompt_token_ids[0] == BOS  # add_special_tokens defaults to true
    assert (converted.detokenize, converted.skip_special_tokens, converted.stop) == (True, True, ())
    assert len(converted.request_id) == 32  # assigned


def test_explicit_zeros_are_kept() -> None:
    request = generate_pb2.GenerateRequest(text="ab", add_special_tokens=False, request_id="r1")
    request.sampling.temperature = 0.0
    request.sampling.seed = 0
    request.output.logprobs = 0
    request.output.return_text = False
    converted = _convert(request)
    assert converted.params.is_greedy
    assert (converted.params.seed, converted.params.logprobs) == (0, 0)
    assert converted.detokenize is False
    assert converted.prompt_token_ids[0] != BOS
    assert converted.request_id == "r1"


def test_every_knob_reaches_the_engine_under_its_name() -> None:
    request = generate_pb2.GenerateRequest(text="ab")
    s = request.sampling
    s.n, s.temperature, s.top_p, s.top_k, s.min_p = 3, 0.5, 0.75, 7, 0.125
    s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.seed = 1.25, 0.5, -0.5, 2**40
    request.stopping.max_tokens, request.stopping.min_tokens, request.stopping.ignore_eos = 9, 2, True
    request.output.logprobs, request.output.prompt_logprobs = 4, 1
    params = _convert(request).params
    assert (params.n, params.temperature, params.top_p) == (3, 0.5, 0.75)
    assert (params.top_k, params.min_p) == (7, 0.125)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.25, 0.5, -0.5)
    assert (params.seed, params.max_tokens, params.min_tokens, params.ignore_eos) == (2**40, 9, 2, True)
    assert (params.logprobs, params.prompt_logprobs) == (4, 1)
    # Every field of the request's sampling message is one the conversion knows.
    fields = {f.name for f in generate_pb2.SamplingParams.DESCRIPTOR.fields}
    assert fields == {*convert._SAMPLING_FIELDS, "logit_bias"}


def test_chat_adds_the_generation_prompt_by_default() -> None:
    request = generate_pb2.GenerateRequest()
    request.chat.messages.add(role="user", content="hi")
    with_prompt = _convert(request).prompt_token_ids
    request.chat.add_generation_prompt = False
    without = _convert(request).prompt_token_ids
    assert len(with_prompt) > len(without)


def test_logit_bias_and_stop_conditions() -> None:
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 6]))
    request.sampling.logit_bias[9] = -1.5
    request.sampling.logit_bias[3] = 2.0
    request.stopping.stop.extend(["xy"])
    request.stopping.stop_token_ids.extend([7])
    request.stopping.include_stop_string = True
    converted = _convert(request)
    assert converted.params.logit_bias == ((3, 2.0), (9, -1.5))
    assert converted.params.stop_token_ids == (7,)
    assert converted.stop == ("xy",)
    assert converted.include_stop_str_in_output is True


def _tokenize(request: tokenize_pb2.TokenizeRequest) -> tuple[list[int], list[tuple[int, int]] | None]:
    return convert.tokenize_tokenization(request, tokenizer=TOKENIZER, model_info=INFO).run()


def test_tokenize_offsets_only_when_asked() -> None:
    ids, offsets = _tokenize(tokenize_pb2.TokenizeRequest(text="ab"))
    assert offsets is None
    assert len(ids) == 3
    _, offsets = _tokenize(tokenize_pb2.TokenizeRequest(text="ab", return_offsets=True))
    assert offsets == [(0, 0), (0, 1), (1, 2)]


@pytest.mark.parametrize(
    ("exc", "status", "message"),
    [
        (RequestError("top_p", "must be in (0, 1]"), "INVALID_ARGUMENT", "sampling.top_p: must be in (0, 1]"),
        (RequestError("max_tokens", "must be >= 1"), "INVALID_ARGUMENT", "stopping.max_tokens: must be >= 1"),
        (RequestError("logprobs", "bad"), "INVALID_ARGUMENT", "output.logprobs: bad"),
        (EngineOverloaded("full"), "RESOURCE_EXHAUSTED", "full"),
        (EngineDead("the engine is draining"), "UNAVAILABLE", "the engine is draining"),
        (KeyError("secret"), "INTERNAL", "internal server error (details are in the server log)"),
    ],
)
def test_errors_map_in_one_place(exc: Exception, status: str, message: str) -> None:
    error = to_grpc_error(exc, rpc="Generate", request_id="r")
    assert error.status.name == status
    assert error.message == message


def test_requests_with_the_same_knobs_share_their_sampling_params() -> None:
    def request(**sampling: float) -> generate_pb2.GenerateRequest:
        message = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2]))
        for name, value in sampling.items():
            setattr(message.sampling, name, value)
        message.stopping.max_tokens = 5
        return message

    first, again = _convert(request(temperature=0.5)).params, _convert(request(temperature=0.5)).params
    assert again is first  # frozen, so one object serves both
    other = _convert(request(temperature=0.25)).params
    assert (other.temperature, first.temperature) == (0.25, 0.5)
    assert _convert(request(temperature=0.5, top_k=3)).params.top_k == 3
    unset = _convert(request()).params
    assert unset.temperature == 1.0  # unset is not the same as any explicit value
    assert _convert(request(temperature=1.0)).params == unset
    # a set repeated or map field: built per request (and still right), never kept
    with_stops = request(temperature=0.5)
    with_stops.stopping.stop_token_ids.append(3)
    biased = request(temperature=0.5)
    biased.sampling.logit_bias[4] = 1.5
    kept = len(convert._KEPT_PARAMS)
    assert _convert(with_stops).params.stop_token_ids == (3,)
    assert _convert(biased).params.logit_bias == ((4, 1.5),)
    assert _convert(biased).params is not _convert(biased).params
    assert len(convert._KEPT_PARAMS) == kept
    # an invalid request fails every time (a failure is never kept)
    for _ in range(2):
        with pytest.raises(RequestError, match=r"sampling\.top_p"):
            _convert(request(top_p=1.5))
    # a different vocabulary (another model) never reuses a request's params checked against this one
    assert all(key[0] == INFO.vocab_size for key in convert._KEPT_PARAMS)
