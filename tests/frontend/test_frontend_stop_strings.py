"""Stop strings matched on streamed text across arbitrary chunk boundaries."""

from __future__ import annotations

import random

import pytest
from engine_server.frontend.stop_strings import StopStringMatcher


def _reference(text: str, stops: tuple[str, ...], include: bool) -> tuple[str, str | None]:
    """The earliest-ending occurrence in the whole text (longest on a tie)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            key = (start + len(stop), -len(stop), stop)
            best = key if best is None or key < best else best
    if best is None:
        return text, None
    end, _, stop = best
    return text[: end if include else end - len(stop)], stop


def _run(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, str | None]:
    out = []
    for piece in pieces:
        released, matched = matcher.feed(piece)
        out.append(released)
        if matched is not None:
            return "".join(out), matched
    return "".join(out) + matcher.flush(), None


def test_match_across_chunks_holds_back_the_partial_match() -> None:
    matcher = StopStringMatcher(("</end>",), include_in_output=False)
    assert matcher.feed("hello </e") == ("hello ", None)
    assert matcher.feed("n") == ("", None)
    assert matcher.feed("d> tail") == ("", "</end>")


def test_released_when_the_partial_match_breaks() -> None:
    matcher = StopStringMatcher(("abc",), include_in_output=True)
    assert matcher.feed("xab") == ("x", None)
    assert matcher.feed("x") == ("abx", None)
    assert matcher.feed("abc!") == ("abc", "abc")


def test_earliest_ending_match_wins() -> None:
    matcher = StopStringMatcher(("long stop", "on"), include_in_output=True)
    assert matcher.feed("a long stop") == ("a lon", "on")
    tie = StopStringMatcher(("stop", "long stop"), include_in_output=False)
    assert tie.feed("a long stop") == ("a ", "long stop")  # same end: the longer one


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(("",), include_in_output=False)


@pytest.mark.parametrize("include", [False, True])
def test_random_splits_match_the_reference(include: bool) -> None:
    rng = random.Random(7)
    alphabet = "ab🎉 "
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        )
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        matcher = StopStringMatcher(stops, include_in_output=include)
        assert _run(matcher, pieces) == _reference(text, stops, include), (text, stops, pieces)


def test_request_bounds_match_the_contract() -> None:
    from engine_server.engine.types import RequestError
    from engine_server.frontend.outputs import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, GenerateRequest

    GenerateRequest("ok", (1,), stop=("x" * MAX_STOP_STRING_CHARS,) * MAX_STOP_STRINGS)
    for stop in (("",), ("x" * (MAX_STOP_STRING_CHARS + 1),), ("x",) * (MAX_STOP_STRINGS + 1)):
        with pytest.raises(RequestError) as excinfo:
            GenerateRequest("bad", (1,), stop=stop)
        assert excinfo.value.field_name == "stop"


def test_worst_case_holdback_stays_linear() -> None:
    # Text that is a prefix of every stop string at every position: the held-back part stays bounded.
    stops = tuple("a" * 255 + chr(ord("b") + i) for i in range(16))
    matcher = StopStringMatcher(stops, include_in_output=False)
    released = "".join(matcher.feed("a")[0] for _ in range(2000))
    assert released == "a" * (2000 - 255)
