"""LoRA adapters on a real LLMEngine (issue 41): peft's own outputs as the reference, one mixed batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.lora.errors import AdapterExists, AdapterInUse, AdapterNotFound
from engine_server.engine.types import EngineOverloaded, EngineRequest, RequestError, SamplingParams
from engine_testutil import Collected, engine_config, run
from lora_testutil import SPECS, AdapterSpec, build_adapter, peft_greedy, peft_logprobs, peft_model

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


PROMPTS = [_prompt(100 + i, length) for i, length in enumerate((5, 23, 40))]


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for spec in SPECS:
        build_adapter(model_dir, root, spec)
    return root


@pytest.fixture(scope="module")
def lora_engine(model_dir: Path, adapter_root: Path) -> LLMEngine:
    """Every SPECS adapter loaded at launch, one slot each."""
    return LLMEngine(engine_config(
        model_dir, num_kv_blocks=256, max_num_batched_tokens=256, max_adapters=len(SPECS), max_lora_rank=16,
        adapters=tuple((spec.name, str(adapter_root / spec.name)) for spec in SPECS),
        adapter_dir=str(adapter_root)))


def _request(request_id: str, prompt: list[int], adapter: str,
             params: SamplingParams = GREEDY) -> EngineRequest:
    return EngineRequest(request_id, tuple(prompt), params, adapter=adapter)


def _solo(engine: LLMEngine, prompt: list[int], adapter: str) -> list[int]:
    return run(engine, [_request("solo", prompt, adapter)]).tokens[("solo", 0)]


@pytest.mark.parametrize("spec", SPECS, ids=[spec.name for spec in SPECS])
def test_greedy_tokens_equal_peft(lora_engine: LLMEngine, model_dir: Path, adapter_root: Path,
                                  spec: AdapterSpec) -> None:
    reference = peft_model(model_dir, adapter_root / spec.name)
    base = run(lora_engine, [_request(f"b{i}", p, "") for i, p in enumerate(PROMPTS)])
    got = run(lora_engine, [_request(f"r{i}", p, spec.name) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        want = peft_greedy(reference, prompt, MAX_TOKENS)
        assert got.tokens[(f"r{i}", 0)] == want, f"prompt {i}"
    # the adapter matters: otherwise equality with peft would prove nothing
    assert any(got.tokens[(f"r{i}", 0)] != base.tokens[(f"b{i}", 0)] for i in range(len(PROMPTS)))


def test_logprobs_match_peft(lora_engine: LLMEngine, model_dir: Path, adapter_root: Path) -> None:
    spec = SPECS[3]
    reference = peft_model(model_dir, adapter_root / spec.name)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    out = run(lora_engine, [_request("lp", PROMPTS[1], spec.name, params)])
    tokens = out.tokens[("lp", 0)]
    got = [lp.logprob for d in out.deltas for lp in (d.logprobs or [])]
    want = peft_logprobs(reference, PROMPTS[1], tokens)
    assert got == pytest.approx(want, abs=1e-4)


def test_one_batch_mixing_four_adapters_and_base_gives_each_its_solo_tokens(lora_engine: LLMEngine) -> None:
    adapters = ["", *(spec.name for spec in SPECS)]
    cases = [(f"m{i}", _prompt(200 + i, 3 + 7 * i), adapters[i % len(adapters)]) for i in range(15)]
    solo = {rid: _solo(lora_engine, prompt, adapter) for rid, prompt, adapter in cases}
    # all at once: prefills and decodes of every adapter in the same steps
    together = run(lora_engine, [_request(rid, prompt, adapter) for rid, prompt, adapter in cases])
    staggered = run(lora_engine, [_request(rid, prompt, adapter) for rid, prompt, adapter in cases],
                    per_step=2)
    for rid, _, adapter in cases:
        assert together.tokens[(rid, 0)] == solo[rid], f"{rid} ({adapter or 'base'}) in one batch"
        assert staggered.tokens[(rid, 0)] == solo[rid], f"{rid} ({adapter or 'base'}) staggered"


def test_prefix_cache_is_keyed_by_adapter(lora_engine: LLMEngine) -> None:
    prompt = _prompt(300, 40)  # two full blocks of 16 can be reused

    def cached(request_id: str, adapter: str) -> int:
        out = run(lora_engine, [_request(request_id, prompt, adapter)])
        return next(d.num_cached_prompt_tokens for d in out.deltas if d.index == 0 and d.num_prompt_tokens)

    first = [cached(f"c-{a or 'base'}", a) for a in ("", SPECS[0].name, SPECS[1].name)]
    assert first == [0, 0, 0]
    assert cached("c-again", SPECS[0].name) == 32


def test_unknown_adapter_and_unload_rules(lora_engine: LLMEngine, adapter_root: Path) -> None:
    with pytest.raises(RequestError, match="adapter"):
        lora_engine.add_request(_request("unknown", PROMPTS[0], "nope"))
    assert not lora_engine.has_unfinished()
    name = SPECS[0].name
    with pytest.raises(AdapterExists):
        lora_engine.load_adapter(name, name)
    lora_engine.add_request(_request("holds", PROMPTS[0], name))
    with pytest.raises(AdapterInUse):
        lora_engine.unload_adapter(name)
    lora_engine.abort(["holds"])
    lora_engine.step()
    assert not lora_engine.has_unfinished()
    # reloaded under the same name: the old load's KV blocks are never found again
    before = _solo(lora_engine, PROMPTS[2], name)
    lora_engine.unload_adapter(name)
    with pytest.raises(AdapterNotFound):
        lora_engine.unload_adapter(name)
    info = lora_engine.load_adapter(name, name)  # relative to the adapter directory
    assert (info.rank, info.target_modules) == (4, ("q_proj", "v_proj"))
    out = run(lora_engine, [_request("reloaded", PROMPTS[2], name)])
    assert out.tokens[("reloaded", 0)] == before
    assert next(d.num_cached_prompt_tokens for d in out.deltas if d.num_prompt_tokens) == 0


def test_slots_pinned_by_live_requests_are_never_replaced(model_dir: Path, adapter_root: Path) -> None:
    """Two slots, three adapters: a third adapter waits for a slot whose requests ended (the least recently
    used); while both slots' requests live it is refused, and their tokens stay their solo tokens."""
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=128, max_adapters=2, max_lora_rank=16,
                                     adapter_dir=str(adapter_root)))
    names = [spec.name for spec in SPECS[:3]]
    for name in names:
        engine.load_adapter(name, name)
    solo = {name: _solo(engine, PROMPTS[1], name) for name in names}  # (each evicts the least recent)
    assert len(set(map(tuple, solo.values()))) == 3
    engine.add_request(_request("a", PROMPTS[1], names[0]))
    engine.add_request(_request("b", PROMPTS[1], names[1]))
    out = Collected()
    for _ in range(3):
        out.add(engine.step())
    with pytest.raises(EngineOverloaded, match="slots"):
        engine.add_request(_request("c", PROMPTS[1], names[2]))
    while engine.has_unfinished():
        out.add(engine.step())
    assert out.tokens[("a", 0)] == solo[names[0]]
    assert out.tokens[("b", 0)] == solo[names[1]]
    # "a" ended first, so its slot is the least recently used: "c" takes it, "b" stays resident
    engine.add_request(_request("b2", PROMPTS[1], names[1]))
    engine.add_request(_request("c", PROMPTS[1], names[2]))
    resident = {info.name for info in engine.list_adapters() if info.is_resident}
    assert resident == {names[1], names[2]}
    while engine.has_unfinished():
        out.add(engine.step())
    assert out.tokens[("c", 0)] == solo[names[2]]
    assert out.tokens[("b2", 0)] == solo[names[1]]
    assert all(info.num_requests == 0 for info in engine.list_adapters())


def test_unpacked_linears_give_the_same_tokens(model_dir: Path, adapter_root: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """ENGINE_PACKED_LINEARS=0: the hook on the linears' own forwards (and the fused MLP's calls to them)."""
    monkeypatch.setenv("ENGINE_PACKED_LINEARS", "0")
    spec = SPECS[3]  # every projection
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=64, max_adapters=1,
                                     adapters=((spec.name, str(adapter_root / spec.name)),)))
    reference = peft_model(model_dir, adapter_root / spec.name)
    got = run(engine, [_request("u", PROMPTS[1], spec.name)]).tokens[("u", 0)]
    assert got == peft_greedy(reference, PROMPTS[1], MAX_TOKENS)


def test_slot_pressure_with_loads_and_unloads_never_mixes_adapters(model_dir: Path,
                                                                   adapter_root: Path) -> None:
    """Requests of 3 adapters and the base model arrive at random through 2 slots while an idle adapter is
    unloaded and loaded again between steps: a request refused for want of a slot retries later, and every
    request ends with exactly its solo tokens (a slot rewritten under a live request would change them)."""
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=128, max_adapters=2, max_lora_rank=16,
                                     adapter_dir=str(adapter_root)))
    names = [spec.name for spec in SPECS[:3]]
    for name in names:
        engine.load_adapter(name, name)
    prompts = [_prompt(400 + i, 6 + 9 * i) for i in range(3)]
    solo = {(p, a): _solo(engine, prompts[p], a) for p in range(3) for a in ["", *names]}
    rng = random.Random(41)
    pending = [(f"s{i}", rng.randrange(3), rng.choice(["", *names])) for i in range(30)]
    wanted = {rid: solo[(p, a)] for rid, p, a in pending}
    out = Collected()
    num_refused = num_reloads = 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(3)):  # 0-2 arrivals a step
            if not pending:
                break
            rid, p, adapter = pending[0]
            try:
                engine.add_request(_request(rid, prompts[p], adapter))
                pending.pop(0)
            except EngineOverloaded:  # both slots held by other adapters' live requests: retry later
                num_refused += 1
                break
        idle = [info.name for info in engine.list_adapters() if info.num_requests == 0]
        if idle and rng.random() < 0.2:
            engine.unload_adapter(idle[0])
            engine.load_adapter(idle[0], idle[0])
            num_reloads += 1
        out.add(engine.step())
    for rid, tokens in wanted.items():
        assert out.tokens[(rid, 0)] == tokens, rid
    # (the pressure this test is about happened)
    assert num_refused > 0
    assert num_reloads > 0


def test_adapters_under_preemption_chunked_prefill_and_n_greater_than_one(model_dir: Path,
                                                                          adapter_root: Path) -> None:
    """A small KV cache (preemption: recomputed with the request's pinned slot), a small token budget
    (prompts prefilled in chunks, several steps each) and n = 2 (siblings forked with their parent's slot):
    every completion's greedy tokens are its solo tokens, and nothing stays pinned or allocated."""
    names = ["", *(spec.name for spec in SPECS)]
    reference = LLMEngine(engine_config(model_dir, num_kv_blocks=256, max_adapters=len(SPECS),
                                        adapters=tuple((s.name, str(adapter_root / s.name)) for s in SPECS)))
    cases = [(f"p{i}", _prompt(500 + i, 20 + 11 * (i % 4)), names[i % len(names)]) for i in range(16)]
    solo = {rid: _solo(reference, prompt, adapter) for rid, prompt, adapter in cases}
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=24, max_num_batched_tokens=48, max_num_seqs=16,
                                     max_adapters=len(SPECS),
                                     adapters=tuple((s.name, str(adapter_root / s.name)) for s in SPECS)))
    free_at_start = engine.stats().num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    out = run(engine, [_request(rid, prompt, adapter, params) for rid, prompt, adapter in cases], per_step=2)
    for rid, _, adapter in cases:
        assert out.tokens[(rid, 0)] == solo[rid], f"{rid} ({adapter or 'base'})"
        assert out.tokens[(rid, 1)] == solo[rid], f"{rid} ({adapter or 'base'}), completion 1"
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == free_at_start
    assert all(info.num_requests == 0 for info in engine.list_adapters())
