"""Structural-tag formats (parsed from JSON by structural_tag.py) -> a Lark grammar in llguidance's dialect.

Free text is the delicate part. llguidance's lexer is greedy: free text followed by anything would swallow it.
So free text that something follows is one lazy lexeme that ends with what stops it (the end of its tag, a
trigger, the constant after it), matching up to the first place that stop appears. That equals xgrammar's
meaning (text that cannot contain its tag's end nor its triggers, then the end) only where the stop cannot
also occur inside the text, so shapes where it could are refused rather than approximated.

NOTE: every string here is text, as in xgrammar: a trigger like "<tool_call>" is matched as characters, never
as a special token, so a model that emits it as one special token cannot trigger it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import llguidance

from engine_server.engine.types import RequestError

_ANY = "/(?s:.*)/"


@dataclass(frozen=True, slots=True)
class Const:
    value: str


@dataclass(frozen=True, slots=True)
class Json:
    schema: dict[str, Any]


@dataclass(frozen=True, slots=True)
class AnyText:
    excludes: tuple[str, ...]
    path: str


@dataclass(frozen=True, slots=True)
class Sequence:
    elements: tuple[Format, ...]


@dataclass(frozen=True, slots=True)
class Or:
    elements: tuple[Format, ...]


@dataclass(frozen=True, slots=True)
class Tag:
    begin: str
    content: Format
    ends: tuple[str, ...]  # any one of them closes the tag
    path: str


@dataclass(frozen=True, slots=True)
class TriggeredTags:
    triggers: tuple[str, ...]
    tags: tuple[Tag, ...]
    at_least_one: bool
    stop_after_first: bool
    excludes: tuple[str, ...]
    path: str


@dataclass(frozen=True, slots=True)
class TagsWithSeparator:
    tags: tuple[Tag, ...]
    separator: str
    at_least_one: bool
    stop_after_first: bool


Format = Const | Json | AnyText | Sequence | Or | Tag | TriggeredTags | TagsWithSeparator


def grammar_of_format(root: Format) -> str:
    """The llguidance grammar for a tree of formats."""
    lark = _Lark()
    start = lark.expr(root, _END, ()) or _lit("")
    return llguidance.LLMatcher.grammar_from_lark("\n".join([f"start: {start}", *lark.rules]) + "\n")


@dataclass(frozen=True, slots=True)
class _Follow:
    """What comes right after a format: one of `literals` (which the format's expression then includes), the
    end of the output (`at_end`), or neither (its parent matches what follows, so it cannot be free text)."""

    literals: tuple[str, ...] = ()
    at_end: bool = False


_END = _Follow(at_end=True)
_OTHER = _Follow()


class _Lark:
    """Builds one grammar: `expr` returns a rule body and adds the named rules and terminals it needs."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self._texts: dict[tuple[str, ...], str] = {}
        self._schemas: dict[str, str] = {}

    def expr(self, fmt: Format, follow: _Follow, ends: tuple[str, ...]) -> str:
        """`fmt` then `follow`. `ends`: the end strings of the nearest tag around it, which free text anywhere
        inside that tag cannot contain (xgrammar's rule)."""
        then = _choice([_lit(s) for s in follow.literals])
        if isinstance(fmt, Const):
            return _join(_opt_lit(fmt.value), then)
        if isinstance(fmt, Json):
            return _join(self._json(fmt.schema), then)
        if isinstance(fmt, AnyText):
            return self._free_text(fmt.excludes + ends, follow, fmt.path, what="any_text")
        if isinstance(fmt, Or):
            return _choice([self.expr(e, follow, ends) for e in fmt.elements])
        if isinstance(fmt, Sequence):
            return self._sequence(fmt, follow, ends)
        if isinstance(fmt, Tag):
            return _join(self._tag(fmt), then)
        if isinstance(fmt, TriggeredTags):
            return self._triggered(fmt, follow, ends)
        tags = _choice([self._tag(t) for t in fmt.tags])
        more = f"({_join(_opt_lit(fmt.separator), tags)})*" if not fmt.stop_after_first else ""
        body = _join(tags, more)
        return _join(body if fmt.at_least_one else f"({body})?", then)

    def _sequence(self, fmt: Sequence, follow: _Follow, ends: tuple[str, ...]) -> str:
        parts, elements = [], list(fmt.elements)
        for i, element in enumerate(elements):
            if i == len(elements) - 1:
                parts.append(self.expr(element, follow, ends))
                continue
            head = _leading_literal(elements[i + 1]) if _ends_in_text(element) else None
            if head is None:
                parts.append(self.expr(element, _OTHER, ends))
            else:  # free text takes the next element's first string as its stop
                parts.append(self.expr(element, _Follow(literals=(head,)), ends))
                elements[i + 1] = _without_head(elements[i + 1], len(head))
        return _join(*parts)

    def _tag(self, tag: Tag) -> str:
        """begin, content, one of the ends."""
        ends = tuple(e for e in tag.ends if e)
        if len(ends) == len(tag.ends):
            if _ends_in_text(tag.content):
                for a in ends:
                    if any(b != a and b.startswith(a) for b in ends):
                        raise RequestError(f"{tag.path}.end", f"{a!r} starts another end string: free text "
                                                              "before them would always stop at the shorter")
            return _join(_opt_lit(tag.begin), self.expr(tag.content, _Follow(literals=ends), ends))
        if _ends_in_text(tag.content):
            raise RequestError(f"{tag.path}.end", "free text at the end of a tag's content needs a non-empty "
                                                  "end string to stop at")
        return _join(_opt_lit(tag.begin), self.expr(tag.content, _OTHER, ends),
                     _choice([_opt_lit(e) for e in tag.ends]))

    def _triggered(self, fmt: TriggeredTags, follow: _Follow, ends: tuple[str, ...]) -> str:
        then = _choice([_lit(s) for s in follow.literals])
        groups: dict[str, list[str]] = {t: [] for t in fmt.triggers}
        for tag in fmt.tags:
            matched = [t for t in fmt.triggers if tag.begin.startswith(t)]
            if len(matched) != 1:
                raise RequestError(f"{tag.path}.begin", f"{tag.begin!r} must start with exactly one of the "
                                                        f"triggers, starts with {len(matched)}")
            groups[matched[0]].append(self._tag(replace(tag, begin=tag.begin[len(matched[0]):])))
        whole_tags = _choice([self._tag(t) for t in fmt.tags]) if fmt.at_least_one else ""
        if fmt.at_least_one and fmt.stop_after_first:  # exactly one tag, no text around it
            return _join(whole_tags, then)
        stops = fmt.excludes + ends
        for trigger, group in groups.items():
            if not group:
                raise RequestError(f"{fmt.path}.triggers", f"{trigger!r} starts none of the tags")
            # NOTE: free text stops at the first trigger or stop string it meets; where two could end at the
            # same place (or one inside the other) xgrammar's matcher and this one could part ways
            clashes = [o for o in fmt.triggers if o != trigger and o.endswith(trigger)]
            clashes += [o for o in (*stops, *follow.literals) if _overlap(trigger, o)]
            if clashes:
                raise RequestError(f"{fmt.path}.triggers", f"{trigger!r} overlaps {clashes[0]!r}: where the "
                                                           "text stops would be ambiguous")
        text = self._text_terminal(stops + fmt.triggers)
        dispatches = []
        for trigger, group in groups.items():
            name = self._rule("seg", f"[lazy]: {text} {_lit(trigger)}")
            dispatches.append(_join(name, _choice(group)))
        rest = self._free_text(stops + fmt.triggers, follow, fmt.path, what="triggered_tags",
                               ambiguous_unless=stops)
        if fmt.stop_after_first:  # free text, then at most one tag
            return _choice([*(_join(d, then) for d in dispatches), rest])
        body = f"({_choice(dispatches)})* {rest}"
        return _join(whole_tags, body) if fmt.at_least_one else body

    def _free_text(self, stops: tuple[str, ...], follow: _Follow, path: str, *, what: str,
                   ambiguous_unless: tuple[str, ...] | None = None) -> str:
        """Text containing none of `stops`, then `follow`."""
        text = self._text_terminal(stops)
        if follow.at_end:
            return text
        if not follow.literals:
            raise RequestError(path, f"{what} must be last (in the output or in its tag), or be followed "
                                     "by a constant string or a tag")
        for literal in follow.literals:
            if not any(s in literal for s in (stops if ambiguous_unless is None else ambiguous_unless)):
                raise RequestError(path, f"{what} is followed by {literal!r}, which could also occur inside "
                                         "the text; add it (or a part of it) to the text's excludes")
        return self._rule("text", f"[lazy]: {text} {_choice([_lit(s) for s in follow.literals])}")

    def _json(self, schema: dict[str, Any]) -> str:
        """One rule per distinct schema: a schema used twice (a tag first and triggered) compiles once."""
        text = json.dumps(schema)
        name = self._schemas.get(text)
        if name is None:
            name = self._schemas[text] = self._rule("json", f": %json {text}")
        return name

    def _text_terminal(self, stops: tuple[str, ...]) -> str:
        key = tuple(sorted(set(stops)))
        name = self._texts.get(key)
        if name is None:
            name = self._texts[key] = f"TEXT_{len(self._texts)}"
            body = f"{_ANY} & ~({_ANY} {_choice([_lit(s) for s in key])} {_ANY})" if key else _ANY
            self.rules.append(f"{name}: {body}")
        return name

    def _rule(self, prefix: str, definition: str) -> str:
        name = f"{prefix}_{len(self.rules)}"
        self.rules.append(name + definition)
        return name


def _lit(text: str) -> str:
    """A Lark literal for `text`. NOTE: JSON escapes, ASCII only: no raw line separators in the grammar."""
    return json.dumps(text)


def _opt_lit(text: str) -> str:
    """A Lark literal for `text`, or nothing for the empty string."""
    return _lit(text) if text else ""


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _choice(alternatives: list[str]) -> str:
    """One of the alternatives; an empty one makes the whole optional."""
    present = list(dict.fromkeys(a for a in alternatives if a))
    optional = "" in alternatives
    if not present or (len(present) == 1 and not optional):
        return present[0] if present else ""
    return f"({' | '.join(present)})" + ("?" if optional else "")


def _ends_in_text(fmt: Format) -> bool:
    """Whether free text ends the format (so it must know what stops it)."""
    if isinstance(fmt, AnyText):
        return True
    if isinstance(fmt, TriggeredTags):
        return not (fmt.at_least_one and fmt.stop_after_first)
    if isinstance(fmt, Sequence):
        return _ends_in_text(fmt.elements[-1])
    if isinstance(fmt, Or):
        return any(_ends_in_text(e) for e in fmt.elements)
    return False


def _leading_literal(fmt: Format) -> str | None:
    """The string every match of `fmt` starts with, where the format says so outright."""
    if isinstance(fmt, Const | Tag):
        head = fmt.value if isinstance(fmt, Const) else fmt.begin
        return head or None
    if isinstance(fmt, Sequence):
        return _leading_literal(fmt.elements[0])
    return None


def _without_head(fmt: Format, size: int) -> Format:
    """`fmt` less the first `size` characters of its leading literal (free text before it matched them)."""
    if isinstance(fmt, Const):
        return Const(fmt.value[size:])
    if isinstance(fmt, Tag):
        return replace(fmt, begin=fmt.begin[size:])
    assert isinstance(fmt, Sequence)
    return Sequence((_without_head(fmt.elements[0], size), *fmt.elements[1:]))


def _overlap(a: str, b: str) -> bool:
    """Whether one string contains the other, or one's end is the other's start."""
    return (a in b or b in a or any(a.endswith(b[:k]) for k in range(1, len(b)))
            or any(b.endswith(a[:k]) for k in range(1, len(a))))
