"""A completion's text is decode(prompt + completion) minus decode(prompt), streamed (issue #37, item 5).

SentencePiece's Metaspace decoder drops the leading space of a sequence's first token only: a completion
decoded on its own lost it ("Paris" after "The capital of France is", where a full decode has " Paris").
Checked on Llama-2-style tokenizers built locally (BPE with byte fallback; tokenizers' Metaspace decoder and
Llama-2's Replace/ByteFallback/Fuse/Strip chain) and on the tiny model's byte-level BPE, by every
detokenizer (byte-level tables, DecodeStream, the prefix-offset method), token by token, in groups and in
one go; then through AsyncEngine (stop strings, n > 1, a consumer that reads once at the end).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from engine_server.engine.types import SamplingParams
from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.detokenizer import Detokenizer, DetokenizerFactory
from engine_server.frontend.outputs import GenerateOutput, GenerateRequest
from engine_server.frontend.tokenizer import Tokenizer
from fake_core import fake_config, fake_factory, fake_validate
from metaspace_tokenizer import DECODERS, build_metaspace_tokenizer, metaspace_model_dir

TIMEOUT = 10.0
SAMPLES = (
    "The capital of France is Paris.", "Hello, world!", "你好\uff0c世界\u3002这是一个测试",
    "🎉🚀😀 emoji 👩‍👩‍👧 family", "naïve café — ½ ∑ ∞", "  two  spaces\nand\ta tab",
    "def add(a: int, b: int) -> int:\n    return a + b", "€1 = ¥150", "mixed 混合 🎉 text",
)
TOKENIZERS = [*DECODERS, "byte_level"]
# "default": what the server uses (tables for byte-level BPE, DecodeStream otherwise); "decode_stream" and
# "prefix_offsets": the general detokenizer on every tokenizer, byte-level included.
MODES = ["default", "decode_stream", "prefix_offsets"]
FEEDS = ["token", "groups", "once"]


@pytest.fixture(scope="module")
def tokenizers(tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    built = {name: Tokenizer(build_metaspace_tokenizer(tmp_path_factory.mktemp(name), decoder=name))
             for name in DECODERS}
    return {**built, "byte_level": tokenizer}


def _factory(tokenizer: Tokenizer, mode: str) -> DetokenizerFactory:
    if mode == "default":
        return tokenizer.detokenizers
    return DetokenizerFactory(tokenizer.backend, None, use_decode_stream=mode == "decode_stream")


def _target(tokenizer: Tokenizer, prompt: list[int], completion: list[int], skip: bool) -> str | None:
    """decode(prompt + completion) minus decode(prompt); None where the latter is no prefix of the former (the
    completion's bytes changed a character the prompt ended with: there is no such difference)."""
    before = tokenizer.decode(prompt, skip_special_tokens=skip)
    whole = tokenizer.decode(prompt + completion, skip_special_tokens=skip)
    return whole[len(before):] if whole.startswith(before) else None


def _stream(detokenizer: Detokenizer, token_ids: list[int], feed: str, rng: random.Random) -> list[str]:
    if feed == "token":
        pieces = [detokenizer.add(token_id) for token_id in token_ids]
    elif feed == "once":
        pieces = [detokenizer.add_many(token_ids)] if token_ids else []
    else:  # random-sized groups, as coalesced engine deltas arrive
        pieces, position = [], 0
        while position < len(token_ids):
            size = rng.randint(1, 4)
            pieces.append(detokenizer.add_many(token_ids[position:position + size]))
            position += size
    return [*pieces, detokenizer.finish()]


def _completion_text(
    tokenizer: Tokenizer, mode: str, prompt: list[int], completion: list[int], *, skip: bool,
    feed: str = "token", rng: random.Random | None = None,
) -> list[str]:
    factory = _factory(tokenizer, mode)
    context = factory.prompt_context(prompt, skip_special_tokens=skip)
    detokenizer = factory.new(context, skip_special_tokens=skip)
    return _stream(detokenizer, completion, feed, rng or random.Random(0))


def _random_case(tokenizer: Tokenizer, rng: random.Random) -> tuple[list[int], list[int]]:
    vocab_size = tokenizer.vocab_size
    kind = rng.random()
    if kind < 0.3:  # arbitrary ids: special tokens, bytes that do and do not form characters
        return ([rng.randrange(vocab_size) for _ in range(rng.randint(1, 16))],
                [rng.randrange(vocab_size) for _ in range(rng.randint(0, 24))])
    text = " ".join(rng.choice(SAMPLES) for _ in range(rng.randint(1, 3)))
    ids = tokenizer.encode(text).token_ids  # BOS first
    if kind < 0.7:  # words, cut anywhere (inside a character too, as a token-id prompt may be)
        cut = rng.randint(1, len(ids))
        return ids[:cut], ids[cut:]
    if kind < 0.85:  # a text prompt, then arbitrary ids
        return ids, [rng.randrange(vocab_size) for _ in range(rng.randint(1, 24))]
    # a completion that starts with special tokens (end of turn, EOS), then words
    specials = sorted(tokenizer.special_ids)
    words = tokenizer.encode(rng.choice(SAMPLES), add_special_tokens=False).token_ids
    return ids, [rng.choice(specials) for _ in range(rng.randint(1, 2))] + words


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", TOKENIZERS)
def test_streamed_text_is_the_full_decode_minus_the_prompt(
    tokenizers: dict[str, Tokenizer], name: str, mode: str, feed: str
) -> None:
    tokenizer = tokenizers[name]
    rng = random.Random(f"{name}-{mode}-{feed}")
    num_checked = 0
    for _ in range(300):
        prompt, completion = _random_case(tokenizer, rng)
        skip = rng.random() < 0.7
        pieces = _completion_text(tokenizer, mode, prompt, completion, skip=skip, feed=feed, rng=rng)
        target = _target(tokenizer, prompt, completion, skip)
        if target is None:
            continue  # (it must not fail, and did not)
        num_checked += 1
        released = ""
        for piece in pieces:  # what is released is final
            released += piece
            assert target.startswith(released), (prompt, completion, skip, pieces, target)
        assert released == target, (prompt, completion, skip, pieces, target)
    assert num_checked > 200  # (the prompt's text is a prefix of the whole text in most cases)


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_completion_keeps_its_leading_space(
    tokenizers: dict[str, Tokenizer], name: str, mode: str, feed: str
) -> None:
    tokenizer = tokenizers[name]
    prompt = tokenizer.encode("The capital of France is").token_ids
    whole = tokenizer.encode("The capital of France is Paris. €😀 ok").token_ids
    assert whole[:len(prompt)] == prompt
    pieces = _completion_text(tokenizer, mode, prompt, whole[len(prompt):], skip=True, feed=feed)
    assert "".join(pieces) == " Paris. €😀 ok"
    assert next(piece for piece in pieces if piece).startswith(" P")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize(("skip", "expected"), [(True, " Paris"), (False, "<|end|></s> Paris")])
def test_a_completion_that_starts_with_special_tokens(
    tokenizers: dict[str, Tokenizer], name: str, mode: str, skip: bool, expected: str
) -> None:
    tokenizer = tokenizers[name]
    prompt = tokenizer.encode("The capital of France is").token_ids
    words = tokenizer.encode("is Paris", add_special_tokens=False).token_ids[1:]  # " Paris", not "Paris"
    specials = [tokenizer.backend.token_to_id("<|end|>"), tokenizer.backend.token_to_id("</s>")]
    for feed in FEEDS:
        pieces = _completion_text(tokenizer, mode, prompt, specials + words, skip=skip, feed=feed)
        assert "".join(pieces) == expected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_prompt_cut_inside_a_character(tokenizers: dict[str, Tokenizer], name: str, mode: str) -> None:
    tokenizer = tokenizers[name]
    ids = tokenizer.encode("price: €€ ok").token_ids
    # every cut of the token ids, inside the euro signs' bytes too
    for cut in range(1, len(ids)):
        prompt, completion = ids[:cut], ids[cut:]
        before = tokenizer.decode(prompt)
        for feed in FEEDS:
            text = "".join(_completion_text(tokenizer, mode, prompt, completion, skip=True, feed=feed))
            if before.endswith("\ufffd"):  # the completion completes the prompt's last character
                assert before[:-1].rstrip("\ufffd") + text == "price: €€ ok", (cut, feed, text)
            else:
                assert before + text == "price: €€ ok", (cut, feed, text)
        # a completion that leaves the prompt's character incomplete adds nothing for it
        stray = tokenizer.encode("x", add_special_tokens=False).token_ids
        target = _target(tokenizer, prompt, stray, True)
        assert target is not None
        assert "".join(_completion_text(tokenizer, mode, prompt, stray, skip=True)) == target


@pytest.mark.parametrize("mode", ["decode_stream", "prefix_offsets"])
def test_a_decoder_that_rewrites_released_text_does_not_fail(mode: str) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    # "ab" -> "X" across tokens: "a" is released before "b" turns it into "X" (DecodeStream raises there).
    backend = Backend(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    factory = DetokenizerFactory(backend, None, use_decode_stream=mode == "decode_stream")
    for feed in FEEDS:
        context = factory.prompt_context([3], skip_special_tokens=True)
        detokenizer = factory.new(context, skip_special_tokens=True)
        text = "".join(_stream(detokenizer, [1, 2, 3, 1], feed, random.Random(0)))
        assert text.startswith(("a", "X"))
        assert len(text) == len(backend.decode([3, 1, 2, 3, 1])) - 1  # as long as the full decode's rest


# --- through AsyncEngine: the fake core echoes the prompt, so the completion repeats it ---------------------


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_server.models.tiny import default_model_dir

    return metaspace_model_dir(default_model_dir(), tmp_path_factory.mktemp("metaspace-model"))


@pytest.fixture
async def metaspace_engine(metaspace_dir: Path) -> AsyncIterator[AsyncEngine]:
    engine = await AsyncEngine.start(
        fake_config(metaspace_dir), in_process=True,
        engine_factory=fake_factory(1024, step_delay=0.001), validator=fake_validate,
    )
    yield engine
    await engine.shutdown(timeout=5.0)


async def _collect(
    engine: AsyncEngine, request: GenerateRequest, *, read_at_end: bool
) -> list[GenerateOutput]:
    async with asyncio.timeout(TIMEOUT):
        stream = engine.generate(request)
        if read_at_end:  # the whole completion reaches the detokenizer in one output ("non-streaming")
            await engine.wait_idle()
        return [output async for output in stream]


def _chunks(outputs: list[GenerateOutput], index: int) -> tuple[str, list[int]]:
    chunks = [chunk for output in outputs for chunk in output.chunks if chunk.index == index]
    token_ids = [token_id for chunk in chunks for token_id in chunk.token_ids]
    return "".join(chunk.text for chunk in chunks), token_ids


@pytest.mark.parametrize("read_at_end", [False, True])
@pytest.mark.parametrize("skip", [True, False])
async def test_engine_completions_join_their_prompt(
    metaspace_engine: AsyncEngine, read_at_end: bool, skip: bool
) -> None:
    tokenizer = metaspace_engine.tokenizer
    for number, text in enumerate(SAMPLES):
        prompt = tokenizer.encode(text).token_ids  # <s> first: the echo starts with a special token
        params = SamplingParams(n=3, max_tokens=2 * len(prompt) + 1)
        request = GenerateRequest(f"join-{number}-{skip}", tuple(prompt), params, skip_special_tokens=skip)
        outputs = await _collect(metaspace_engine, request, read_at_end=read_at_end)
        for index in range(3):
            completion_text, completion_ids = _chunks(outputs, index)
            assert len(completion_ids) == 2 * len(prompt) + 1
            whole = tokenizer.decode(prompt + completion_ids, skip_special_tokens=skip)
            assert tokenizer.decode(prompt, skip_special_tokens=skip) + completion_text == whole
            if number == 0:
                assert completion_text.startswith(" The capital of France is Paris. The" if skip else
                                                  "<s> The capital of France is Paris.<s> The")


@pytest.mark.parametrize("read_at_end", [False, True])
@pytest.mark.parametrize("include", [False, True])
async def test_engine_stop_strings_see_the_leading_space(
    metaspace_engine: AsyncEngine, read_at_end: bool, include: bool
) -> None:
    tokenizer = metaspace_engine.tokenizer
    prompt = tokenizer.encode("The capital of France is Paris.").token_ids
    # The completion is " The capital of France is Paris. The ...": " The" is matched only with its space.
    params = SamplingParams(n=2, max_tokens=60)
    request = GenerateRequest("stop", tuple(prompt), params, stop=("is Paris. The", " The c"),
                              include_stop_str_in_output=include)
    outputs = await _collect(metaspace_engine, request, read_at_end=read_at_end)
    for index in range(2):
        completion_text, completion_ids = _chunks(outputs, index)
        assert completion_text == (" The c" if include else "")
        # the ids end with the token that completed the match
        assert _target(tokenizer, prompt, completion_ids, True) == " The ca"
    finals = [chunk for output in outputs for chunk in output.chunks if chunk.finish_reason is not None]
    assert sorted((chunk.index, chunk.stop_reason) for chunk in finals) == [(0, " The c"), (1, " The c")]
