"""Sampling knobs end to end: seeds, logprobs, n > 1, logit_bias, stop ids, min_tokens, penalties."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import EngineRequest, FinishReason, SamplingParams
from engine_testutil import engine_config, reference_greedy, run

EOS = 1
# Logprobs are compared with log_softmax of the reference model's logits (float32, same weights,
# different attention kernel and batch shape): agreement to 1e-4 absolute.
LOGPROB_TOL = 1e-4


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 1000) for _ in range(length))


def test_seeded_sampling_is_independent_of_the_batch(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=200, min_p=0.01, seed=1234, max_tokens=24)
    target = EngineRequest("seeded", _prompt(1, 21), params)
    alone = run(engine, [target]).tokens[("seeded", 0)]
    noise = [EngineRequest(f"noise{i}", _prompt(100 + i, 5 + 7 * i),
                           SamplingParams(temperature=1.0 + i / 10, max_tokens=5 + 3 * i)) for i in range(8)]
    # The same request again, joining mid-flight among other requests.
    crowded = run(engine, [*noise[:4], EngineRequest("seeded", target.prompt_token_ids, params), *noise[4:]],
                  per_step=2)
    assert crowded.tokens[("seeded", 0)] == alone
    assert len(alone) == 24


def test_seeded_n_gives_distinct_reproducible_completions(engine: LLMEngine) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16)
    first = run(engine, [EngineRequest("n3", _prompt(2, 30), params)])
    second = run(engine, [EngineRequest("n3", _prompt(2, 30), params)])
    outs = [first.tokens[("n3", i)] for i in range(3)]
    assert outs == [second.tokens[("n3", i)] for i in range(3)]
    assert len({tuple(o) for o in outs}) == 3
    assert all(first.finish[("n3", i)] is FinishReason.LENGTH for i in range(3))
    # Index 0 of a seeded n>1 request equals the n=1 request with the same seed.
    single = run(engine, [EngineRequest("n1", _prompt(2, 30), SamplingParams(temperature=1.0, seed=7,
                                                                             max_tokens=16))])
    assert single.tokens[("n1", 0)] == outs[0]


def test_n_greedy_completions_share_the_prompt_and_match_generate(engine: LLMEngine, ref_model: Any) -> None:
    free_at_start = engine.stats().num_free_blocks
    prompt = _prompt(3, 37)
    got = run(engine, [EngineRequest("g", prompt, SamplingParams(n=4, temperature=0.0, max_tokens=12))])
    want = reference_greedy(ref_model, [list(prompt)], [12], eos_id=EOS)[0]
    assert [got.tokens[("g", i)] for i in range(4)] == [want] * 4
    firsts = [d for d in got.deltas if d.num_prompt_tokens]
    assert len(firsts) == 1
    assert firsts[0].index == 0
    assert firsts[0].num_prompt_tokens == 37
    assert engine.stats().num_free_blocks == free_at_start


def test_logprobs_match_reference_log_softmax(engine: LLMEngine, ref_model: Any) -> None:
    prompt = _prompt(4, 25)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, prompt_logprobs=3)
    got = run(engine, [EngineRequest("lp", prompt, params)])
    output = got.tokens[("lp", 0)]
    with torch.inference_mode():
        logits = ref_model(torch.tensor([list(prompt) + output], device=ref_model.device)).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)
    logprobs = [lp for d in got.deltas for lp in (d.logprobs or [])]
    assert len(logprobs) == len(output)
    for j, (token, lp) in enumerate(zip(output, logprobs, strict=True)):
        row = ref[len(prompt) - 1 + j]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(row[token].item(), abs=LOGPROB_TOL)
        assert lp.rank == 1  # greedy picks the most likely token
        assert [t for t, _ in lp.top] == row.topk(5).indices.tolist()
        for top_id, top_lp in lp.top:
            assert top_lp == pytest.approx(row[top_id].item(), abs=LOGPROB_TOL)
    prompt_lps = next(d.prompt_logprobs for d in got.deltas if d.prompt_logprobs is not None)
    assert prompt_lps is not None
    assert len(prompt_lps) == len(prompt)
    assert prompt_lps[0] is None
    for p in range(1, len(prompt)):
        entry = prompt_lps[p]
        assert entry is not None
        assert entry.token_id == prompt[p]
        assert entry.logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=LOGPROB_TOL)
        assert entry.rank == int((ref[p - 1] > ref[p - 1, prompt[p]]).sum()) + 1
        assert len(entry.top) == 3


@pytest.mark.parametrize("budget", [16, 1], ids=["chunks-of-16", "chunks-of-1"])
def test_prompt_logprobs_across_prefill_chunks(model_dir: Any, ref_model: Any, budget: int) -> None:
    # NOTE: 1-token chunks are laid out as decodes are (model_runner's single-token rows)
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=64, max_num_batched_tokens=budget))
    prompt = _prompt(5, 50)  # four chunks of at most 16 tokens, or 50 of one
    got = run(engine, [EngineRequest("c", prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                                 prompt_logprobs=0))])
    with torch.inference_mode():
        ids = torch.tensor([list(prompt)], device=ref_model.device)
        ref = torch.log_softmax(ref_model(ids).logits[0].float(), dim=-1)
    prompt_lps = next(d.prompt_logprobs for d in got.deltas if d.prompt_logprobs is not None)
    assert prompt_lps is not None
    values = [e.logprob for e in prompt_lps[1:] if e is not None]
    want = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    assert values == pytest.approx(want, abs=LOGPROB_TOL)


def test_logit_bias_stop_ids_min_tokens_and_ignore_eos(engine: LLMEngine) -> None:
    prompt = _prompt(6, 12)
    requests = [
        # +100 on a token makes greedy pick it every time
        EngineRequest("bias", prompt, SamplingParams(temperature=0.0, max_tokens=5,
                                                     logit_bias=((77, 100.0),))),
        # ... and as a stop token id it ends the completion at once
        EngineRequest("stop", prompt, SamplingParams(temperature=0.0, max_tokens=5, logit_bias=((77, 100.0),),
                                                     stop_token_ids=(77,))),
        # EOS is masked until min_tokens exist
        EngineRequest("min", prompt, SamplingParams(temperature=0.0, max_tokens=9, min_tokens=4,
                                                    logit_bias=((EOS, 100.0),))),
        # ignore_eos: EOS is an ordinary token
        EngineRequest("ign", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                    logit_bias=((EOS, 100.0),))),
    ]
    got = run(engine, requests)
    assert got.tokens[("bias", 0)] == [77] * 5
    assert got.finish[("bias", 0)] is FinishReason.LENGTH
    assert got.tokens[("stop", 0)] == [77]
    assert got.finish[("stop", 0)] is FinishReason.STOP
    stop_delta = next(d for d in got.deltas if d.request_id == "stop")
    assert stop_delta.stop_token_id == 77
    assert got.tokens[("min", 0)][4] == EOS
    assert EOS not in got.tokens[("min", 0)][:4]
    assert got.finish[("min", 0)] is FinishReason.STOP
    assert len(got.tokens[("min", 0)]) == 5
    assert got.tokens[("ign", 0)] == [EOS] * 3
    assert got.finish[("ign", 0)] is FinishReason.LENGTH


def test_repetition_penalty_avoids_seen_tokens(engine: LLMEngine) -> None:
    prompt = _prompt(7, 10)
    # The bias makes token 77 the greedy choice once; a huge repetition penalty then forbids it.
    params = SamplingParams(temperature=0.0, max_tokens=6, logit_bias=((77, 8.0),), repetition_penalty=1e6)
    tokens = run(engine, [EngineRequest("rep", prompt, params)]).tokens[("rep", 0)]
    assert len(set(tokens)) == len(tokens)
    assert not set(tokens) & set(prompt)


def test_max_model_len_ends_with_length(model_dir: Any) -> None:
    engine = LLMEngine(engine_config(model_dir, max_model_len=40, num_kv_blocks=16))
    params = SamplingParams(temperature=0.0, ignore_eos=True)  # no max_tokens: up to max_model_len
    got = run(engine, [EngineRequest("long", _prompt(8, 30), params)])
    assert len(got.tokens[("long", 0)]) == 10
    assert got.finish[("long", 0)] is FinishReason.LENGTH
