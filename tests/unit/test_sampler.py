"""Sampler on hand-made logits: greedy, top_k / top_p / min_p, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import torch
from engine_server.engine.sampler import Sampler
from engine_server.engine.sequence import Sequence
from engine_server.engine.types import SamplingParams

VOCAB = 8


def _seq(params: SamplingParams, tokens: list[int] | None = None, num_prompt: int = 1,
         seed: int | None = None) -> Sequence:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return Sequence(seq_id=0, request_id="r", index=0, params=params, token_ids=tokens or [0],
                    num_prompt_tokens=num_prompt, max_tokens=16, generator=gen)


def _sampler() -> Sampler:
    return Sampler(vocab_size=VOCAB, eos_token_ids=(1,))


LOGITS = torch.tensor([[0.0, 1.0, 3.0, 2.0, -1.0, 0.5, 2.5, -2.0]])


def _samples(params: SamplingParams, n: int = 300, logits: torch.Tensor = LOGITS) -> set[int]:
    seq = _seq(params, seed=0)
    tokens, _ = _sampler()(logits.expand(n, VOCAB).clone(), [seq] * n)
    return set(tokens)


def test_greedy_is_argmax() -> None:
    tokens, lps = _sampler()(LOGITS.clone(), [_seq(SamplingParams(temperature=0.0))])
    assert tokens == [2]
    assert lps == [None]


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    assert _samples(SamplingParams(temperature=1.0, top_k=2)) == {2, 6}
    probs = torch.softmax(LOGITS[0], dim=0)
    # top_p just above p(2): token 2 and then 6 are needed to reach it
    assert _samples(SamplingParams(temperature=1.0, top_p=float(probs[2]) + 0.01)) == {2, 6}
    assert _samples(SamplingParams(temperature=1.0, top_p=float(probs[2]) - 0.01)) == {2}
    # min_p keeps tokens with p >= min_p * p_max: logits >= 3 + ln(0.5) ~ 2.31
    assert _samples(SamplingParams(temperature=1.0, min_p=0.5)) == {2, 6}


def test_penalties_and_bias_follow_openai_semantics() -> None:
    sampler = _sampler()
    # output tokens are [2, 2]: frequency 1.0 twice + presence 0.5 -> 3 - 2.5 = 0.5 < token 6's 2.5
    seq = _seq(SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5), tokens=[0, 2, 2])
    assert sampler(LOGITS.clone(), [seq])[0] == [6]
    # repetition penalty divides positive logits of seen tokens (prompt included)
    seq = _seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), tokens=[2, 6], num_prompt=1)
    assert sampler(LOGITS.clone(), [seq])[0] == [3]
    seq = _seq(SamplingParams(temperature=0.0, logit_bias=((7, 10.0),)))
    assert sampler(LOGITS.clone(), [seq])[0] == [7]
    # min_tokens masks EOS (id 1) and stop ids
    logits = LOGITS.clone()
    logits[0, 1] = 50.0
    seq = _seq(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,)))
    assert sampler(logits, [seq])[0] == [6]


def test_seeded_rows_do_not_depend_on_their_neighbours() -> None:
    sampler = _sampler()
    params = SamplingParams(temperature=1.0)
    alone = [sampler(LOGITS.clone(), [_seq(params, seed=5)])[0][0] for _ in range(1)]
    seqs = [_seq(params), _seq(params, seed=5), _seq(params)]
    mixed = sampler(LOGITS.expand(3, VOCAB).clone(), seqs)[0]
    assert mixed[1] == alone[0]
    run1 = [sampler(LOGITS.clone(), [s])[0][0] for s in [_seq(params, seed=9)] * 20]
    run2 = [sampler(LOGITS.clone(), [s])[0][0] for s in [_seq(params, seed=9)] * 20]
    assert run1 == run2


def test_logprobs_are_raw_log_softmax_with_rank_and_top() -> None:
    params = SamplingParams(temperature=0.0, logprobs=3, logit_bias=((7, 100.0),))
    tokens, lps = _sampler()(LOGITS.clone(), [_seq(params)])
    raw = torch.log_softmax(LOGITS[0], dim=0)
    lp = lps[0]
    assert tokens == [7]
    assert lp is not None
    assert math.isclose(lp.logprob, float(raw[7]), abs_tol=1e-6)  # raw logits: the bias is not included
    assert lp.rank == VOCAB
    assert [t for t, _ in lp.top] == [2, 6, 3]
