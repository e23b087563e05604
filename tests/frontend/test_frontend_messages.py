"""StepOutput: plain deltas (new tokens of completion 0, nothing else) travel as columns, every other delta as
an object; nothing is lost or changed across the pickle boundary."""

from __future__ import annotations

import pickle

from engine_server.engine.types import CompletionDelta, EngineStats, FinishReason, TokenLogprob
from engine_server.frontend.messages import ErrorInfo, StepOutput

STATS = EngineStats(num_running=3, num_waiting=1, num_free_blocks=10, num_total_blocks=20)


def _deltas() -> list[CompletionDelta]:
    return [
        CompletionDelta("a", 0, [5, 6]),  # plain
        CompletionDelta("b", 0, [7], num_prompt_tokens=4),  # first output: prompt counts ride on it
        CompletionDelta("c", 1, [8]),  # completion 1 of n
        CompletionDelta("d", 0, [9], logprobs=[TokenLogprob(9, -0.5, 1)]),
        CompletionDelta("e", 0, [], finish_reason=FinishReason.LENGTH),
        CompletionDelta("f", 0, [1], finish_reason=FinishReason.STOP, stop_token_id=1),
        CompletionDelta("g", 0, [], finish_reason=FinishReason.ERROR, error="boom"),
        CompletionDelta("h", 0, [2]),  # plain
    ]


def test_only_plain_deltas_become_columns() -> None:
    output = StepOutput.of(_deltas(), STATS, [])
    assert output.token_request_ids == ["a", "h"]
    assert output.token_ids == [[5, 6], [2]]
    assert [delta.request_id for delta in output.deltas] == ["b", "c", "d", "e", "f", "g"]
    assert len(output.token_request_ids) + len(output.deltas) == len(_deltas())


def test_a_pickled_step_output_carries_every_delta_unchanged() -> None:
    rejected = [("x", ErrorInfo("request", "too long", "prompt"))]
    received = pickle.loads(pickle.dumps(StepOutput.of(_deltas(), STATS, rejected)))
    rebuilt = [CompletionDelta(request_id, 0, token_ids)
               for request_id, token_ids in zip(received.token_request_ids, received.token_ids, strict=True)]
    rebuilt += received.deltas
    assert sorted(rebuilt, key=lambda d: d.request_id) == _deltas()
    assert received.stats == STATS
    assert received.rejected == rejected
