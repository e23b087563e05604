"""PlainResponses: the reused message serializes exactly as a fresh `streaming_response` for plain outputs,
and declines every other kind (which then takes the general builder)."""

from __future__ import annotations

from engine_server.api import responses
from engine_server.engine.types import FinishReason, TokenLogprob
from engine_server.frontend.outputs import CompletionChunk, GenerateOutput


def _output(*chunks: CompletionChunk, finished: bool = False) -> GenerateOutput:
    return GenerateOutput("req-7", list(chunks), 12, 0, None, finished)


def _chunk(ids: list[int], text: str = "", index: int = 0, **extra: object) -> CompletionChunk:
    chunk = CompletionChunk(index, ids, text, None, None, None, 3)
    for name, value in extra.items():
        setattr(chunk, name, value)
    return chunk


def test_plain_outputs_serialize_like_a_fresh_message_however_often_reused() -> None:
    plain = responses.PlainResponses("req-7")
    sequence = [_chunk([5]), _chunk([300, 70000, 1], " héllo 🎉"), _chunk([], "x"), _chunk([2**31], ""),
                _chunk([9, 9, 9], "")]
    for chunk in sequence:
        output = _output(chunk)
        expected_counts = [0]
        expected = responses.streaming_response(output, expected_counts).SerializeToString()
        counts = [0]
        assert plain.serialize(output, counts) == expected
        assert counts == expected_counts


def test_every_other_output_is_declined() -> None:
    plain = responses.PlainResponses("req-7")
    declined = [
        _output(_chunk([1]), finished=True),
        _output(_chunk([1], index=1)),
        _output(_chunk([1]), _chunk([2], index=1)),
        _output(_chunk([1], logprobs=[TokenLogprob(1, -0.1, 1)])),
        _output(_chunk([1], finish_reason=FinishReason.LENGTH)),
        GenerateOutput("req-7", [_chunk([1])], 12, 0, [None, TokenLogprob(4, -1.0, 2)], False),
    ]
    for output in declined:
        counts = [0, 0]
        assert plain.serialize(output, counts) is None
        assert counts == [0, 0]
