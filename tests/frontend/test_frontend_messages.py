"""StepOutput: plain deltas (new tokens of completion 0, nothing else) travel as columns, every other delta as
an object; nothing is lost or changed across the pickle boundary."""

from __future__ import annotations

import pickle

import pytest
from engine_server.core.messages import AddCommand, ErrorInfo, StepOutput
from engine_server.engine.types import (
    CompletionDelta,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestError,
    SamplingParams,
    TokenLogprob,
)

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


def test_sampling_params_cross_the_pipe_equal_and_each_combination_is_built_once() -> None:
    params = SamplingParams(temperature=0.5, top_k=7, max_tokens=9, stop_token_ids=(3, 4), seed=11,
                            logit_bias=((5, 1.5),), logprobs=2)
    received = pickle.loads(pickle.dumps(AddCommand(EngineRequest("r", (1, 2), params))))
    assert received.request.params == params
    same = SamplingParams(temperature=0.5, top_k=7, max_tokens=9, stop_token_ids=(3, 4), seed=11,
                          logit_bias=((5, 1.5),), logprobs=2)
    again = pickle.loads(pickle.dumps(same))
    assert again is received.request.params  # the second request with the same knobs shares the first's
    assert pickle.loads(pickle.dumps(SamplingParams(temperature=0.6))) != params


def test_unpickled_sampling_params_are_still_checked_and_the_shared_ones_bounded() -> None:
    from engine_server.engine import types

    reduced, (values,) = SamplingParams(top_p=0.5).__reduce__()
    bad = tuple(7.5 if value == 0.5 else value for value in values)
    with pytest.raises(RequestError, match="top_p"):
        reduced(bad)  # what unpickling calls: values no constructor accepted are not taken on trust
    for seed in range(types._MAX_UNPICKLED_PARAMS + 10):
        assert pickle.loads(pickle.dumps(SamplingParams(seed=seed))).seed == seed
    assert len(types._UNPICKLED_PARAMS) <= types._MAX_UNPICKLED_PARAMS
