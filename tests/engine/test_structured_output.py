"""Structured output (constrained decoding) through the engine, with the tiny random-weight model.

Random weights are the strongest test: the model prefers nothing in particular, so only the constraint can
make an output valid. Outputs are decoded with the tokenizer's own byte table (strict UTF-8) and checked with
checkers of our own (jsonschema, Python's re, recursive-descent recognizers), never with llguidance. What is
checked is what generate.proto's StructuredOutput promises.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_server.engine.llm_engine import LLMEngine
from engine_server.engine.types import (
    EngineRequest,
    FinishReason,
    RequestError,
    SamplingParams,
    StructuralTagItem,
    StructuredOutput,
    StructuredOutputKind,
)
from engine_testutil import Collected, engine_config, run
from structured_corpus import (
    ARITHMETIC_GRAMMAR,
    REGEXES,
    SCHEMAS,
    SQL_GRAMMAR,
    check_arithmetic,
    check_sql,
    is_compact_json,
    panicking_schema,
    regex_fullmatch,
    schema_errors,
    slow_schema,
)
from tokenizers import Tokenizer

Kind = StructuredOutputKind
EOS = 1
MAX_TOKENS = 256
HOT = 1.5  # the sampled runs' temperature: far from the model's preferences, wherever they are
SAMPLED_SEEDS = (1, 2, 3, 4, 5, 6, 7)  # beside one greedy run per language
# Logprobs are compared with log_softmax of the reference model's logits (as tests/engine/test_sampling.py)
LOGPROB_TOL = 1e-4


def _prompt(seed: int, length: int = 6) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(7, 1000) for _ in range(length))  # 0-6 are special tokens


def _params(seed: int | None, **kwargs: Any) -> SamplingParams:
    """Greedy when seed is None, else sampled hot with that seed."""
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=0.0 if seed is None else HOT, seed=seed, **kwargs)


def _schema(schema: Any) -> StructuredOutput:
    return StructuredOutput(Kind.JSON_SCHEMA, json.dumps(schema))


def _byte_of_char() -> dict[str, int]:
    """A byte-level BPE vocabulary's characters -> bytes (GPT-2's bytes_to_unicode, inverted)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


class TokenText:
    """Token ids -> text through the tokenizer's byte table: strict UTF-8, no special token inside."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.special = set(self.tokenizer.get_added_tokens_decoder())
        byte_of = _byte_of_char()
        self._bytes = {i: bytes(byte_of[c] for c in token)
                       for token, i in self.tokenizer.get_vocab(with_added_tokens=False).items()
                       if i not in self.special}

    def __call__(self, token_ids: Iterable[int], *, is_complete: bool = True) -> str:
        """The text of complete outputs must be valid UTF-8; a cut one may end inside a character."""
        token_ids = list(token_ids)
        inside = [t for t in token_ids if t in self.special]
        assert not inside, f"special tokens {inside} inside a constrained output"
        data = b"".join(self._bytes[t] for t in token_ids)
        return data.decode("utf-8", "strict" if is_complete else "replace")

    def token_id(self, text: str) -> int:
        (token_id,) = self.tokenizer.encode(text, add_special_tokens=False).ids
        return token_id


@dataclass(frozen=True, slots=True)
class Completion:
    token_ids: list[int]  # as emitted: an end-of-sequence token that ended it included
    finish: FinishReason
    stop_token_id: int | None
    text: str  # the output without a special stop token

    def __str__(self) -> str:
        return f"{self.finish.name} {self.text!r}"


def completions(out: Collected, text: TokenText) -> dict[tuple[str, int], Completion]:
    stops = {(d.request_id, d.index): d.stop_token_id for d in out.deltas if d.finish_reason is not None}
    result = {}
    for key, finish in out.finish.items():
        ids = out.tokens[key]
        body = ids[:-1] if ids and ids[-1] == stops[key] and ids[-1] in text.special else ids
        is_cut = finish in (FinishReason.LENGTH, FinishReason.ABORT)
        result[key] = Completion(ids, finish, stops[key], text(body, is_complete=not is_cut))
    return result


def assert_idle(engine: LLMEngine) -> None:
    """Every request ended, every KV block free, nothing refused that was not collected."""
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert engine.pop_rejected() == []


@pytest.fixture(scope="module")
def text(model_dir: Path) -> TokenText:
    return TokenText(model_dir)


@pytest.fixture(scope="module")
def so_engine(model_dir: Path) -> LLMEngine:
    """This module's engine: room for a few hundred constrained requests at once; tests leave it idle."""
    return LLMEngine(engine_config(model_dir, num_kv_blocks=2048, max_num_batched_tokens=1024))


# 1-3) the corpus: every JSON schema, regex and Lark grammar, greedy and hot with several seeds, in one batch

LANGUAGES: dict[str, StructuredOutput] = {
    **{f"json_schema/{name}": _schema(schema) for name, schema in SCHEMAS},
    **{f"regex/{name}": StructuredOutput(Kind.REGEX, pattern) for name, pattern in REGEXES},
    "grammar/arithmetic": StructuredOutput(Kind.GRAMMAR, ARITHMETIC_GRAMMAR),
    "grammar/sql": StructuredOutput(Kind.GRAMMAR, SQL_GRAMMAR),
}


@pytest.fixture(scope="module")
def corpus(so_engine: LLMEngine, text: TokenText) -> dict[str, list[Completion]]:
    """Each language's completions (greedy first), all from one batch."""
    requests = [EngineRequest(f"{language}#{run_}", _prompt(run_ * 1000 + i), _params(seed), constraint)
                for i, (language, constraint) in enumerate(LANGUAGES.items())
                for run_, seed in enumerate((None, *SAMPLED_SEEDS))]
    out = completions(run(so_engine, requests), text)
    assert_idle(so_engine)
    return {language: [out[(f"{language}#{run_}", 0)] for run_ in range(1 + len(SAMPLED_SEEDS))]
            for language in LANGUAGES}


def test_the_corpus_covers_json_schema_keywords() -> None:
    assert len(SCHEMAS) >= 30
    used: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            used.update(node)
            for key, value in node.items():
                if key not in ("properties", "patternProperties", "$defs", "const", "enum"):
                    walk(value)
                elif key in ("properties", "patternProperties", "$defs"):
                    for child in value.values():
                        walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk([schema for _, schema in SCHEMAS])
    wanted = {"properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
              "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "pattern", "format",
              "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
              "multipleOf", "patternProperties", "minProperties", "maxProperties", "$id", "$comment",
              "examples", "default", "title", "description", "$schema"}
    assert wanted <= used, wanted - used
    formats = {schema.get("format") for _, schema in SCHEMAS} | {
        p.get("format") for _, s in SCHEMAS for p in s.get("properties", {}).values()}
    assert {"date", "date-time", "time", "email", "uuid", "ipv4", "ipv6", "hostname"} <= formats


@pytest.mark.parametrize("name", [name for name, _ in SCHEMAS])
def test_json_schema_outputs_are_valid(corpus: dict[str, list[Completion]], name: str) -> None:
    schema = dict(SCHEMAS)[name]
    for completion in corpus[f"json_schema/{name}"]:
        assert completion.finish is FinishReason.STOP, completion
        assert schema_errors(schema, completion.text) == [], completion
        assert is_compact_json(completion.text), completion  # no x-guidance: compact


@pytest.mark.parametrize("name", [name for name, _ in REGEXES])
def test_regex_outputs_match_in_full(corpus: dict[str, list[Completion]], name: str) -> None:
    pattern = dict(REGEXES)[name]
    for completion in corpus[f"regex/{name}"]:
        assert completion.finish is FinishReason.STOP, completion
        assert regex_fullmatch(pattern, completion.text), completion


@pytest.mark.parametrize(("name", "check"), [("arithmetic", check_arithmetic), ("sql", check_sql)])
def test_lark_grammar_outputs_parse(corpus: dict[str, list[Completion]], name: str, check: Any) -> None:
    for completion in corpus[f"grammar/{name}"]:
        assert completion.finish is FinishReason.STOP, completion
        check(completion.text)


def test_sampled_outputs_vary(corpus: dict[str, list[Completion]]) -> None:
    """The hot runs explore each language (or the checks above would see one output per language)."""
    varied = [language for language, runs in corpus.items() if len({c.text for c in runs}) >= 3]
    assert len(varied) >= 0.8 * len(corpus), sorted(set(corpus) - set(varied))


def test_token_text_agrees_with_the_tokenizer(corpus: dict[str, list[Completion]], text: TokenText) -> None:
    for runs in corpus.values():
        for completion in runs:
            assert text.tokenizer.decode(completion.token_ids) == completion.text


# 4) choice, json_object, structural tags

CHOICES = {
    "sentiment": ("positive", "negative", "neutral"),
    "prefixes": ("a", "ab", "abc", "abcd"),  # after "a" the language may end or go on
    "shared_start": ("New York", "New Delhi", "Newcastle"),
    "unicode": ("日本語", "中文", "한국어"),
    "duplicates": ("yes", "yes", "no", "no"),
    "one": ("the only answer",),
}


def test_choice_outputs_are_exactly_one_choice(so_engine: LLMEngine, text: TokenText) -> None:
    requests = [EngineRequest(f"{name}#{seed}", _prompt(100 * i + (seed or 0)), _params(seed),
                              StructuredOutput(Kind.CHOICE, choices=choices))
                for i, (name, choices) in enumerate(CHOICES.items()) for seed in (None, *SAMPLED_SEEDS)]
    out = completions(run(so_engine, requests), text)
    assert_idle(so_engine)
    for name, choices in CHOICES.items():
        runs = [out[(f"{name}#{seed}", 0)] for seed in (None, *SAMPLED_SEEDS)]
        for completion in runs:
            assert completion.finish is FinishReason.STOP, completion
            assert completion.text in choices, completion
        if len(set(choices)) > 1:
            assert len({c.text for c in runs}) > 1, f"{name}: every run gave {runs[0]}"


def test_json_object_outputs_are_json_objects(so_engine: LLMEngine, text: TokenText) -> None:
    # NOTE: nothing bounds a json_object's strings; a bias towards '"', '}' and ']' closes them soon (a bias
    # cannot make a token the constraint forbids possible, so this changes no validity)
    bias = tuple((text.token_id(s), 7.0) for s in ('"', "}", "]"))
    requests = [EngineRequest(f"object#{seed}", _prompt(seed or 0), _params(seed, logit_bias=bias),
                              StructuredOutput(Kind.JSON_OBJECT)) for seed in (None, *range(1, 16))]
    out = completions(run(so_engine, requests), text)
    assert_idle(so_engine)
    values = []
    for completion in out.values():
        assert completion.finish is FinishReason.STOP, completion
        values.append(json.loads(completion.text))
        assert isinstance(values[-1], dict), completion
        assert is_compact_json(completion.text), completion
    assert sum(1 for v in values if v) >= 4  # not only {}


WEATHER_SCHEMA = {"type": "object",
                  "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
FLAGS_SCHEMA = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}


def tagged_calls(output: str, *, trigger: str, tags: dict[str, tuple[Any, str]]) -> list[tuple[str, Any]]:
    """The tags in a structural tag's output: (begin, value) each; asserts that every trigger starts a tag,
    whose JSON is compact and valid under its schema (None: any JSON), followed by the tag's end."""
    found = []
    pos = 0
    while (start := output.find(trigger, pos)) != -1:
        begin = next((b for b in tags if output.startswith(b, start)), None)
        assert begin is not None, f"a trigger at {start} does not begin a tag: {output!r}"
        schema, end = tags[begin]
        value, value_end = json.JSONDecoder().raw_decode(output, start + len(begin))
        raw = output[start + len(begin):value_end]
        assert is_compact_json(raw), f"{raw!r} in {output!r}"
        if schema is not None:
            assert schema_errors(schema, raw) == [], f"{raw!r} in {output!r}"
        assert output.startswith(end, value_end), f"{begin} without its end {end!r}: {output!r}"
        found.append((begin, value))
        pos = value_end + len(end)
    return found


def test_structural_tags_follow_every_trigger(so_engine: LLMEngine, text: TokenText) -> None:
    tags = {"<w>": (WEATHER_SCHEMA, "</w>"), "<f>": (FLAGS_SCHEMA, "</f>"), "<any>": (None, "</any>")}
    constraint = StructuredOutput(Kind.STRUCTURAL_TAG, triggers=("<",), tags=tuple(
        StructuralTagItem(begin, json.dumps(schema) if schema is not None else "", end)
        for begin, (schema, end) in tags.items()))
    # NOTE: biases make the test see many tags and still end: towards "<", triggers are common in the free
    # text; towards "w" and "f", each tag is picked; towards EOS, the free text ends soon (EOS is allowed only
    # between tags); towards '"', "]" and "}", the any-JSON tag's strings, arrays and objects close soon
    bias = ((text.token_id("<"), 3.0), (text.token_id("w"), 2.0), (text.token_id("f"), 3.0), (EOS, 6.0),
            *((text.token_id(s), 6.0) for s in ('"', "]", "}")))
    requests = [EngineRequest(f"tags#{seed}", _prompt(seed or 0), _params(seed, logit_bias=bias), constraint)
                for seed in (None, *range(1, 48))]
    out = completions(run(so_engine, requests), text)
    assert_idle(so_engine)
    found = []
    for completion in out.values():
        assert completion.finish is FinishReason.STOP, completion
        assert completion.stop_token_id == EOS
        found += tagged_calls(completion.text, trigger="<", tags=tags)
    assert {begin for begin, _ in found} == set(tags), "every tag was used"


def test_a_trigger_that_looks_like_a_special_token_is_text(so_engine: LLMEngine, text: TokenText) -> None:
    """A trigger is a string (generate.proto): "<tool>" is text to match even where the tokenizer has no such
    special token."""
    constraint = StructuredOutput(Kind.STRUCTURAL_TAG, triggers=("<tool>",), tags=(
        StructuralTagItem("<tool>", json.dumps(WEATHER_SCHEMA), "</tool>"),))
    bias = ((EOS, 6.0),)
    out = run(so_engine, [EngineRequest(f"tool#{seed}", _prompt(seed), _params(seed, logit_bias=bias),
                                        constraint) for seed in range(4)])
    assert so_engine.pop_rejected() == []
    for completion in completions(out, text).values():
        assert completion.finish is FinishReason.STOP, completion
        tagged_calls(completion.text, trigger="<tool>", tags={"<tool>": (WEATHER_SCHEMA, "</tool>")})
    assert_idle(so_engine)


# 5) n > 1, seeds, logprobs

ORDER = dict(SCHEMAS)["order"]


def test_n_completions_are_each_valid_and_seeds_repeat(so_engine: LLMEngine, text: TokenText) -> None:
    constraint = _schema(ORDER)
    prompt = _prompt(51, 20)
    first = completions(run(so_engine, [
        EngineRequest("n11", prompt, _params(11, n=6), constraint),
        EngineRequest("n12", prompt, _params(12, n=6), constraint),
        EngineRequest("greedy", prompt, _params(None, n=3), constraint),
    ]), text)
    for key, completion in first.items():
        assert completion.finish is FinishReason.STOP, (key, completion)
        assert schema_errors(ORDER, completion.text) == [], (key, completion)
    seed11 = [first[("n11", i)].text for i in range(6)]
    seed12 = [first[("n12", i)].text for i in range(6)]
    assert len(set(seed11)) == 6  # each completion has its own seed
    assert all(a != b for a, b in zip(seed11, seed12, strict=True))  # the request's seed matters
    # greedy completions fork from one matcher state: all equal, and equal to n = 1
    greedy = {first[("greedy", i)].text for i in range(3)}
    single = completions(run(so_engine, [EngineRequest("single", prompt, _params(None), constraint)]), text)
    assert greedy == {single[("single", 0)].text}
    # the same seeded request again, in another batch (other constrained and unconstrained requests around it)
    crowd = [EngineRequest(f"crowd{i}", _prompt(60 + i, 9), _params(60 + i, max_tokens=40),
                           _schema(SCHEMAS[i][1]) if i % 2 else None) for i in range(8)]
    again = run(so_engine, [*crowd[:4], EngineRequest("n11", prompt, _params(11, n=6), constraint),
                            *crowd[4:]], per_step=3)
    assert [again.tokens[("n11", i)] for i in range(6)] == [first[("n11", i)].token_ids for i in range(6)]
    assert_idle(so_engine)


def test_logprobs_are_raw_and_one_per_token(so_engine: LLMEngine, text: TokenText, ref_model: Any) -> None:
    prompt = _prompt(52, 12)
    constraint = _schema(dict(SCHEMAS)["nested_objects"])
    out = run(so_engine, [EngineRequest("greedy", prompt, _params(None, logprobs=3), constraint),
                          EngineRequest("hot", prompt, _params(5, logprobs=0), constraint)])
    # asking for logprobs changes no token (a batch without them masks the logits in place)
    without = run(so_engine, [EngineRequest("greedy", prompt, _params(None), constraint),
                              EngineRequest("hot", prompt, _params(5), constraint)])
    assert_idle(so_engine)
    assert out.tokens == without.tokens
    for request_id, num_top in (("greedy", 3), ("hot", 0)):
        tokens = out.tokens[(request_id, 0)]
        logprobs = [lp for d in out.deltas if d.request_id == request_id for lp in (d.logprobs or [])]
        assert len(logprobs) == len(tokens)
        with torch.inference_mode():
            logits = ref_model(torch.tensor([list(prompt) + tokens], device=ref_model.device)).logits[0]
        ref = torch.log_softmax(logits.float(), dim=-1)
        for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            row = ref[len(prompt) - 1 + j]
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(row[token].item(), abs=LOGPROB_TOL)  # the model's, unmasked
            assert lp.rank == int((row > row[token]).sum()) + 1
            assert [t for t, _ in lp.top] == row.topk(num_top).indices.tolist()
        if request_id == "greedy":
            # the constraint overrode the model's first choice somewhere (raw logprobs show by how much)
            assert any(lp.rank > 1 for lp in logprobs)


# 6) unconstrained requests in a mixed batch get exactly their tokens from a run without constraints

def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(so_engine: LLMEngine) -> None:
    plain = [
        EngineRequest("greedy", _prompt(70, 17), SamplingParams(temperature=0.0, max_tokens=30)),
        EngineRequest("seeded", _prompt(71, 5), SamplingParams(temperature=1.0, seed=3, max_tokens=30)),
        EngineRequest("knobs", _prompt(72, 33), SamplingParams(
            temperature=0.8, top_k=50, top_p=0.9, seed=4, repetition_penalty=1.2, max_tokens=30, logprobs=2)),
        EngineRequest("n2", _prompt(73, 9), SamplingParams(n=2, temperature=1.2, seed=5, max_tokens=30)),
        EngineRequest("greedy-lp", _prompt(74, 40), SamplingParams(temperature=0.0, max_tokens=30,
                                                                   logprobs=1)),
    ]
    languages = [_schema(ORDER), StructuredOutput(Kind.REGEX, REGEXES[0][1]),
                 StructuredOutput(Kind.GRAMMAR, SQL_GRAMMAR),
                 StructuredOutput(Kind.CHOICE, choices=("x", "y")), StructuredOutput(Kind.JSON_OBJECT)]
    constrained = [EngineRequest(f"c{i}", _prompt(80 + i, 3 + 4 * i),
                                 _params(i or None, n=1 + i % 2, logprobs=1 if i % 3 else None), constraint)
                   for i, constraint in enumerate(languages)]
    alone = run(so_engine, plain)
    mixed = run(so_engine, [r for pair in zip(constrained, plain, strict=True) for r in pair])
    assert_idle(so_engine)
    for request in plain:
        for index in range(request.params.n):
            key = (request.request_id, index)
            assert mixed.tokens[key] == alone.tokens[key], key
    def logprobs(out: Collected, request_id: str) -> list[float]:
        return [lp.logprob for d in out.deltas if d.request_id == request_id for lp in d.logprobs or []]

    for request_id in ("knobs", "greedy-lp"):
        assert logprobs(mixed, request_id) == pytest.approx(logprobs(alone, request_id), abs=1e-5)


# 7) lifecycle: preemption, prefix cache, aborts, refusals, finish reasons

def test_next_masks_fill_as_a_step_ends(so_engine: LLMEngine, text: TokenText,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding constrained completions, each step takes the masks started as the step before ended (filled
    while its outputs went out); a constrained request joining mid-way gets a fill of its own, and every
    output stays valid."""
    steps: list[tuple[bool, int]] = []  # per step with masks: (started the step before, rows filled)
    start_masks = LLMEngine._start_masks

    def spy(self: LLMEngine, scheduled: Any) -> Any:
        early = self._next_masks
        masks = start_masks(self, scheduled)
        if masks is not None:
            steps.append((masks is early, len(masks.row_of)))
        return masks

    monkeypatch.setattr(LLMEngine, "_start_masks", spy)
    schema = _schema(WEATHER_SCHEMA)
    first = [EngineRequest(f"early#{i}", _prompt(300 + i), _params(None, ignore_eos=True), schema)
             for i in range(2)]
    for request in first:
        so_engine.add_request(request)
    out = Collected()
    for _ in range(4):
        out.add(so_engine.step())
    so_engine.add_request(EngineRequest("late", _prompt(310), _params(None), schema))
    while so_engine.has_unfinished():
        out.add(so_engine.step())
    assert_idle(so_engine)
    got = completions(out, text)
    assert set(got) == {("early#0", 0), ("early#1", 0), ("late", 0)}
    for completion in got.values():
        assert completion.finish is FinishReason.STOP, completion
        assert schema_errors(WEATHER_SCHEMA, completion.text) == [], completion
    reused = [early for early, _ in steps[1:]]
    assert sum(reused) >= len(reused) - 2, steps  # all but where a request joined (and the first step)
    assert not all(reused), steps  # the late request's first step: its mask was not among the early ones


def test_preempted_constrained_requests_stay_valid(model_dir: Path, text: TokenText) -> None:
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=20, max_num_batched_tokens=64, max_num_seqs=12))
    long_list = {"type": "array", "minItems": 5, "maxItems": 6, "items": SCHEMAS[0][1]}
    languages = [(long_list, _schema(long_list)), (None, StructuredOutput(Kind.REGEX, "[a-z]{150,160}"))]
    requests = [EngineRequest(f"p{i}", _prompt(90 + i, 20), _params(i % 3 or None), languages[i % 2][1])
                for i in range(10)]
    out = completions(run(engine, requests), text)
    assert engine.stats().num_preemptions > 0
    assert_idle(engine)
    for i, request in enumerate(requests):
        completion = out[(request.request_id, 0)]
        assert completion.finish is FinishReason.STOP, completion
        schema = languages[i % 2][0]
        if schema is not None:
            assert schema_errors(schema, completion.text) == [], completion
        else:
            assert re.fullmatch("[a-z]{150,160}", completion.text), completion


def test_a_prefix_cache_hit_changes_nothing(so_engine: LLMEngine, text: TokenText) -> None:
    prompt = _prompt(100, 40)  # two full blocks to share
    constraint = _schema(dict(SCHEMAS)["refs_and_defs"])
    first = run(so_engine, [EngineRequest("first", prompt, _params(None), constraint)])
    second = run(so_engine, [EngineRequest("second", prompt, _params(None), constraint),
                             EngineRequest("other", prompt, _params(3), StructuredOutput(Kind.CHOICE,
                                                                                        choices=("a", "b")))],
                 per_step=1)
    assert_idle(so_engine)
    assert [d.num_cached_prompt_tokens for d in first.deltas if d.num_prompt_tokens] == [0]
    assert [d.num_cached_prompt_tokens for d in second.deltas if d.num_prompt_tokens] == [32, 32]
    assert second.tokens[("second", 0)] == first.tokens[("first", 0)]
    assert completions(second, text)[("other", 0)].text in ("a", "b")


def test_abort_while_compiling(so_engine: LLMEngine, text: TokenText) -> None:
    schema = slow_schema("abort while compiling")
    constraint = _schema(schema)
    so_engine.add_request(EngineRequest("slow", _prompt(110), _params(None), constraint))
    assert so_engine.step() == []
    assert so_engine.stats().num_waiting == 1  # waiting for its grammar
    assert so_engine.abort(["slow"]) == ["slow"]
    deltas = so_engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("slow", FinishReason.ABORT)]
    assert_idle(so_engine)
    # the compile went on: the same constraint serves the next request
    out = completions(run(so_engine, [EngineRequest("again", _prompt(111), _params(None), constraint)]), text)
    assert out[("again", 0)].finish is FinishReason.STOP
    assert schema_errors(schema, out[("again", 0)].text) == []
    assert_idle(so_engine)


def test_abort_while_running(so_engine: LLMEngine, text: TokenText) -> None:
    constraint = StructuredOutput(Kind.REGEX, "[a-z]{200}")
    so_engine.add_request(EngineRequest("one", _prompt(120), _params(None), constraint))
    so_engine.add_request(EngineRequest("three", _prompt(121), _params(7, n=3), constraint))
    out = Collected()
    while len(out.tokens[("one", 0)]) < 5:
        out.add(so_engine.step())
    assert so_engine.abort(["one"]) == ["one"]
    assert so_engine.abort_completions([("three", 1)]) == [("three", 1)]
    out.add(so_engine.step())
    assert out.finish[("one", 0)] is FinishReason.ABORT
    assert out.finish[("three", 1)] is FinishReason.ABORT
    while so_engine.has_unfinished():
        out.add(so_engine.step())
    assert_idle(so_engine)
    for index in (0, 2):
        completion = completions(out, text)[("three", index)]
        assert completion.finish is FinishReason.STOP
        assert re.fullmatch("[a-z]{200}", completion.text), completion


def test_chunked_prefill_and_a_completion_aborted_before_the_fork(model_dir: Path, text: TokenText) -> None:
    """Prompts prefilled in chunks (with prompt logprobs); index 0 of n = 3 aborted before its siblings are
    forked from it: they still start from the constraint's start state, and sample as they do without it."""
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=64, max_num_batched_tokens=16))
    constraint = _schema(ORDER)
    n3 = EngineRequest("n3", _prompt(125, 40), _params(5, n=3), constraint)
    logprobs = EngineRequest("lp", _prompt(126, 50), _params(None, prompt_logprobs=2, logprobs=1), constraint)
    engine.add_request(n3)
    engine.add_request(logprobs)
    assert engine.abort_completions([("n3", 0)]) == [("n3", 0)]
    out = Collected()
    while engine.has_unfinished():
        out.add(engine.step())
    assert_idle(engine)
    result = completions(out, text)
    assert result[("n3", 0)].finish is FinishReason.ABORT
    for key in (("n3", 1), ("n3", 2), ("lp", 0)):
        assert result[key].finish is FinishReason.STOP, (key, result[key])
        assert schema_errors(ORDER, result[key].text) == [], (key, result[key])
    (first,) = [d for d in out.deltas if d.request_id == "lp" and d.prompt_logprobs is not None]
    assert len(first.prompt_logprobs or []) == 50
    whole = run(engine, [n3])
    assert [whole.tokens[("n3", i)] for i in (1, 2)] == [out.tokens[("n3", i)] for i in (1, 2)]
    assert_idle(engine)


# (constraint, field_name the error names, a fragment of llguidance's (or the schema parser's) message)
BAD_CONSTRAINTS: dict[str, tuple[StructuredOutput, str, str]] = {
    "bad_regex": (StructuredOutput(Kind.REGEX, "[0-9]+(", field_name="structured_output.regex"),
                  "structured_output.regex", "unclosed group"),
    "lookaround": (StructuredOutput(Kind.REGEX, "(?=a)b"), "regex", "look-around"),
    "bad_lark": (StructuredOutput(Kind.GRAMMAR, "start: item+\n"), "grammar", "unknown name"),
    "lark_syntax": (StructuredOutput(Kind.GRAMMAR, 'start: ("a" "b"\n'), "grammar", "Expected token"),
    "not_json": (StructuredOutput(Kind.JSON_SCHEMA, '{"type": '), "json_schema", "is not valid JSON"),
    "not_a_schema": (StructuredOutput(Kind.JSON_SCHEMA, "[1, 2]"), "json_schema", "must be a JSON object"),
    "invalid_type": (_schema({"type": "strin"}), "json_schema", "strin"),
    "unique_items": (_schema({"type": "array", "uniqueItems": True}), "json_schema", "uniqueItems"),
    "contains": (_schema({"type": "array", "contains": {"type": "integer"}}), "json_schema", "contains"),
    "if_then": (_schema({"if": {"type": "integer"}, "then": {"minimum": 1}}), "json_schema", "if"),
    "unknown_format": (_schema({"type": "string", "format": "colour"}), "json_schema", "colour"),
    "unsupported_format": (_schema({"type": "string", "format": "idn-email"}), "json_schema", "idn-email"),
    "bad_pattern": (_schema({"type": "string", "pattern": "[a-"}), "json_schema", "regex"),
    # NOTE: llguidance takes min/maxProperties only where every property is required, or as 1
    "max_properties": (_schema({"type": "object", "maxProperties": 2, "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}}),
        "json_schema", "maxProperties"),
    "tag_schema": (StructuredOutput(Kind.STRUCTURAL_TAG, triggers=("<",), tags=(
        StructuralTagItem("<a>", "", "</a>"), StructuralTagItem("<b>", "[1]", "</b>"))),
        "structural_tag.tags[1].json_schema", "must be a JSON"),
}


def test_constraints_that_do_not_compile_are_refused(so_engine: LLMEngine, text: TokenText) -> None:
    good = [EngineRequest("good0", _prompt(130), _params(None), _schema(ORDER)),
            EngineRequest("good1", _prompt(131), _params(1),
                          StructuredOutput(Kind.GRAMMAR, ARITHMETIC_GRAMMAR))]
    bad = [EngineRequest(name, _prompt(140 + i), _params(None), constraint)
           for i, (name, (constraint, _, _)) in enumerate(BAD_CONSTRAINTS.items())]
    out = run(so_engine, [*bad[:5], good[0], *bad[5:], good[1]])
    refused = dict(so_engine.pop_rejected())
    assert sorted(refused) == sorted(BAD_CONSTRAINTS)
    for name, (_, field_name, fragment) in BAD_CONSTRAINTS.items():
        error = refused[name]
        assert isinstance(error, RequestError)
        assert (error.field_name, fragment in error.detail) == (field_name, True), (name, error)
        assert not [d for d in out.deltas if d.request_id == name]  # refused, not finished
    result = completions(out, text)
    assert schema_errors(ORDER, result[("good0", 0)].text) == []
    check_arithmetic(result[("good1", 0)].text)
    assert_idle(so_engine)
    # the same constraints again: refused at the first step (their errors are cached)
    for i, request in enumerate(bad):
        so_engine.add_request(EngineRequest(f"again{i}", request.prompt_token_ids, request.params,
                                            request.structured_output))
    assert so_engine.step() == []
    assert sorted(request_id for request_id, _ in so_engine.pop_rejected()) == sorted(
        f"again{i}" for i in range(len(bad)))
    assert_idle(so_engine)


def test_a_library_panic_refuses_the_request_without_a_backtrace(so_engine: LLMEngine) -> None:
    """llguidance's panic message is the client's error; its native backtrace (with the server's build paths)
    is not."""
    out = run(so_engine, [EngineRequest("panic", _prompt(145), _params(None), _schema(panicking_schema()))])
    assert not out.deltas
    ((request_id, error),) = so_engine.pop_rejected()
    assert (request_id, error.field_name) == ("panic", "json_schema")
    assert "assertion failed" in error.detail
    assert "backtrace" not in error.detail
    assert len(error.detail.splitlines()) == 1, error.detail
    assert_idle(so_engine)


def test_max_tokens_first_ends_with_length(so_engine: LLMEngine, text: TokenText) -> None:
    long_choice = "an answer that takes many more tokens than allowed"
    out = completions(run(so_engine, [
        EngineRequest("digits", _prompt(150), _params(None, max_tokens=7), StructuredOutput(Kind.REGEX,
                                                                                            "[0-9]{100}")),
        EngineRequest("choice", _prompt(151), _params(2, max_tokens=3),
                      StructuredOutput(Kind.CHOICE, choices=(long_choice, long_choice.upper()))),
    ]), text)
    assert_idle(so_engine)
    digits, choice = out[("digits", 0)], out[("choice", 0)]
    assert (digits.finish, len(digits.token_ids)) == (FinishReason.LENGTH, 7)
    assert re.fullmatch("[0-9]{1,99}", digits.text), digits  # an incomplete prefix
    assert (choice.finish, len(choice.token_ids)) == (FinishReason.LENGTH, 3)
    assert any(c.startswith(choice.text) and c != choice.text for c in (long_choice, long_choice.upper()))
    # the language ends on the last token max_tokens allows: STOP
    exact = StructuredOutput(Kind.CHOICE, choices=(long_choice,))
    whole = run(so_engine, [EngineRequest("whole", _prompt(152), _params(None), exact)]).tokens[("whole", 0)]
    tie = run(so_engine, [EngineRequest("tie", _prompt(152), _params(None, max_tokens=len(whole)), exact)])
    assert (tie.tokens[("tie", 0)], tie.finish[("tie", 0)]) == (whole, FinishReason.STOP)
    assert_idle(so_engine)


def test_stop_token_ids_end_a_constrained_completion(so_engine: LLMEngine, text: TokenText) -> None:
    constraint = StructuredOutput(Kind.REGEX, "[a-z]{60}")
    prompt = _prompt(160)
    full = run(so_engine, [EngineRequest("full", prompt, _params(None), constraint)]).tokens[("full", 0)]
    cut = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    stopped = completions(run(so_engine, [
        EngineRequest("stopped", prompt, _params(None, stop_token_ids=(full[cut],)), constraint)]), text)
    assert_idle(so_engine)
    completion = stopped[("stopped", 0)]
    assert (completion.finish, completion.stop_token_id) == (FinishReason.STOP, full[cut])
    assert completion.token_ids == full[:cut + 1]  # the stop token is part of the output, which is incomplete
    assert re.fullmatch("[a-z]{1,59}", completion.text), completion


def test_min_tokens_masks_stops_until_the_language_ends(so_engine: LLMEngine, text: TokenText) -> None:
    # a strong bias towards EOS: it ends the output wherever it is allowed
    eos_bias = ((EOS, 20.0),)
    digits = StructuredOutput(Kind.REGEX, "[0-9]{1,40}")
    choice = StructuredOutput(Kind.CHOICE, choices=("yes", "no"))
    out = completions(run(so_engine, [
        EngineRequest("early", _prompt(170), _params(None, logit_bias=eos_bias), digits),
        EngineRequest("min6", _prompt(170), _params(None, logit_bias=eos_bias, min_tokens=6), digits),
        EngineRequest("min6-hot", _prompt(171), _params(9, logit_bias=eos_bias, min_tokens=6), digits),
        EngineRequest("choice", _prompt(172), _params(None, logit_bias=eos_bias, min_tokens=10,
                                                      max_tokens=20), choice),
        EngineRequest("choice-ignore-eos", _prompt(173), _params(4, ignore_eos=True, max_tokens=20), choice),
        EngineRequest("ignore-eos", _prompt(174), _params(None, ignore_eos=True, logit_bias=eos_bias),
                      StructuredOutput(Kind.REGEX, "[a-z]{1,30}")),
        # the end of sequence is never allowed before the sentence is complete, whatever its bias
        EngineRequest("json", _prompt(175), _params(6, logit_bias=((EOS, 100.0),)), _schema(ORDER)),
        EngineRequest("object", _prompt(176), _params(None, logit_bias=(
            (EOS, 100.0), *((text.token_id(s), 6.0) for s in ('"', "}", "]")))),
            StructuredOutput(Kind.JSON_OBJECT)),
    ]), text)
    assert_idle(so_engine)
    for key, completion in out.items():
        assert completion.finish is FinishReason.STOP, (key, completion)
    early, min6, min6_hot = out[("early", 0)], out[("min6", 0)], out[("min6-hot", 0)]
    assert (len(early.token_ids), early.stop_token_id) == (2, EOS)  # one digit, then EOS at once
    for completion in (min6, min6_hot):
        assert (len(completion.token_ids), completion.stop_token_id) == (7, EOS), completion
        assert re.fullmatch("[0-9]{6,40}", completion.text), completion
    # the language's end wins over min_tokens and over ignore_eos
    assert out[("choice", 0)].text in ("yes", "no")
    assert out[("choice-ignore-eos", 0)].text in ("yes", "no")
    ignored = out[("ignore-eos", 0)]
    assert (len(ignored.token_ids), ignored.stop_token_id) == (2, EOS), ignored
    assert schema_errors(ORDER, out[("json", 0)].text) == []
    assert isinstance(json.loads(out[("object", 0)].text), dict)


def test_a_dead_end_ends_the_completion_without_a_token(so_engine: LLMEngine, text: TokenText) -> None:
    """A grammar that cannot be completed after "a" (x never derives a string): after "a" nothing is allowed,
    so the completion ends with DEAD_END and no end-of-sequence token; its neighbours go on."""
    dead = StructuredOutput(Kind.GRAMMAR, 'start: "a" x\nx: x "b"\n')
    requests = [EngineRequest("dead", _prompt(180), _params(None), dead),
                EngineRequest("dead-n2", _prompt(181), _params(3, n=2, ignore_eos=True), dead),
                EngineRequest("alive", _prompt(182), _params(None), _schema(ORDER))]
    out = completions(run(so_engine, requests), text)
    assert_idle(so_engine)
    for key in (("dead", 0), ("dead-n2", 0), ("dead-n2", 1)):
        assert (out[key].finish, out[key].token_ids, out[key].stop_token_id) == (
            FinishReason.DEAD_END, [text.token_id("a")], None), (key, out[key])
    assert out[("alive", 0)].finish is FinishReason.STOP
    assert schema_errors(ORDER, out[("alive", 0)].text) == []


# 8) the compile timeout

def test_the_tokenizer_build_is_not_a_constraints_compile_time(model_dir: Path, text: TokenText,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The first constraint an engine sees builds llguidance's tokenizer (in a fresh process, with its
    imports, 2 s here; longer for a large vocabulary): that is not the constraint's compile time, which for a
    small regex is a millisecond."""
    from engine_server.engine.structured import compiler

    build = compiler.load_llg_tokenizer

    def slow_build(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)  # a large vocabulary's build
        return build(*args, **kwargs)

    monkeypatch.setattr(compiler, "load_llg_tokenizer", slow_build)
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=32, grammar_compile_timeout_s=0.25))
    out = completions(run(engine, [EngineRequest("first", _prompt(190), _params(None),
                                                 StructuredOutput(Kind.REGEX, "[0-9]{4}"))]), text)
    assert_idle(engine)
    assert re.fullmatch("[0-9]{4}", out[("first", 0)].text)


def test_a_compile_past_the_timeout_is_refused(model_dir: Path, text: TokenText) -> None:
    engine = LLMEngine(engine_config(model_dir, num_kv_blocks=64, grammar_compile_timeout_s=0.25))
    run(engine, [EngineRequest("warm", _prompt(200), _params(None), StructuredOutput(Kind.REGEX, "[0-9]"))])
    assert_idle(engine)
    plain = EngineRequest("plain", _prompt(201, 30), SamplingParams(temperature=0.0, max_tokens=40))
    alone = run(engine, [plain]).tokens[("plain", 0)]
    slow = _schema(slow_schema("compile timeout"))  # most of a second to compile here
    out = run(engine, [EngineRequest("slow", _prompt(202), _params(None), slow), plain])
    # meanwhile the unconstrained request ran as it does alone
    assert out.tokens[("plain", 0)] == alone
    assert out.finish[("plain", 0)] is FinishReason.LENGTH
    ((request_id, error),) = engine.pop_rejected()
    assert (request_id, error.field_name) == ("slow", "json_schema")
    assert "took longer than 0.25 s" in error.detail
    assert not [d for d in out.deltas if d.request_id == "slow"]
    # the same constraint again is refused at its first step
    engine.add_request(EngineRequest("slow-again", _prompt(203), _params(None), slow))
    assert engine.step() == []
    ((request_id, error),) = engine.pop_rejected()
    assert request_id == "slow-again"
    assert "took longer than" in error.detail
    assert_idle(engine)


# llguidance 1.9.1 never returns from some masks (a Lark terminal /x+/ followed by the literal "x"): the
# engine must not stall on them. In a child process (structured_stall_probe.py): a stuck llguidance thread
# cannot be stopped, and would spin in the test process for the rest of the session.

def _stall_probe(scenario: str, model_dir: Path) -> dict[str, Any]:
    probe = Path(__file__).with_name("structured_stall_probe.py")
    child = subprocess.run([sys.executable, str(probe), scenario, str(model_dir)], capture_output=True,
                           text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    report: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.slow
def test_a_grammar_whose_compile_never_ends_blocks_no_other_constraint(model_dir: Path) -> None:
    report = _stall_probe("compile", model_dir)
    assert not report["stalled"]
    assert "took longer than 1 s" in report["refused"].get("hang", ""), report
    assert report["finish"].get("plain") == "LENGTH", report
    # a quick constraint sent afterwards compiles: the stuck compile must not hold the compile threads
    assert report["finish"].get("after") == "STOP", report
    assert report["is_idle"], report


@pytest.mark.slow
def test_a_grammar_whose_mask_never_ends_does_not_stall_the_engine(model_dir: Path) -> None:
    report = _stall_probe("mask", model_dir)
    assert not report["stalled"], f"a step never returned (its mask fill is stuck in llguidance): {report}"
    assert (report["finish"].get("plain"), report["num_tokens"].get("plain")) == ("LENGTH", 20), report
    assert "hang" in report["finish"], report
    assert report["is_idle"], report
