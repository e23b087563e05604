"""Structural tags as JSON (what the vLLM-compatible service receives) -> an llguidance grammar.

Two forms arrive. vLLM's legacy one, {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, is
xgrammar's `triggered_tags` (xgrammar itself converts it so), and xgrammar's own, {"type": "structural_tag",
"format": FORMAT}, is a tree of formats. Both go one way: JSON -> the small dataclasses below (every error
names its JSON path) -> a Lark grammar in llguidance's dialect.

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

MAX_DEPTH = 32  # nesting of formats; deeper trees are refused

_ANY = "/(?s:.*)/"


@dataclass(frozen=True, slots=True)
class _Const:
    value: str


@dataclass(frozen=True, slots=True)
class _Json:
    schema: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _AnyText:
    excludes: tuple[str, ...]
    path: str


@dataclass(frozen=True, slots=True)
class _Sequence:
    elements: tuple[_Format, ...]


@dataclass(frozen=True, slots=True)
class _Or:
    elements: tuple[_Format, ...]


@dataclass(frozen=True, slots=True)
class _Tag:
    begin: str
    content: _Format
    ends: tuple[str, ...]  # any one of them closes the tag
    path: str


@dataclass(frozen=True, slots=True)
class _TriggeredTags:
    triggers: tuple[str, ...]
    tags: tuple[_Tag, ...]
    at_least_one: bool
    stop_after_first: bool
    excludes: tuple[str, ...]
    path: str


@dataclass(frozen=True, slots=True)
class _TagsWithSeparator:
    tags: tuple[_Tag, ...]
    separator: str
    at_least_one: bool
    stop_after_first: bool


_Format = _Const | _Json | _AnyText | _Sequence | _Or | _Tag | _TriggeredTags | _TagsWithSeparator


def grammar_of_structural_tag_json(field_name: str, text: str) -> str:
    """The llguidance grammar for a structural tag in either JSON form; RequestError names the JSON path."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise RequestError(field_name, f"is not valid JSON: {exc}") from None
    top = _object(value, field_name)
    if "format" in top:
        _only_keys(top, field_name, {"type", "format"})
        _type_is(top, field_name, "structural_tag")
        root = _parse(top["format"], f"{field_name}.format", 1)
    elif "structures" in top:
        _only_keys(top, field_name, {"type", "structures", "triggers"})
        _type_is(top, field_name, "structural_tag")
        root = _parse_legacy(top, field_name)
    else:
        raise RequestError(field_name, 'needs "format" (xgrammar\'s form) or "structures" and "triggers" '
                                       "(vLLM's form)")
    lark = _Lark()
    start = lark.expr(root, _END, ()) or _lit("")
    return llguidance.LLMatcher.grammar_from_lark("\n".join([f"start: {start}", *lark.rules]) + "\n")


# 1) JSON -> formats

def _parse_legacy(top: dict[str, Any], path: str) -> _TriggeredTags:
    triggers = _strings(top, "triggers", path, required=True)
    items = top.get("structures")
    if not isinstance(items, list) or not items:
        raise RequestError(f"{path}.structures", "must be a non-empty list of {begin, schema, end}")
    tags = []
    for i, item in enumerate(items):
        where = f"{path}.structures[{i}]"
        obj = _object(item, where)
        _only_keys(obj, where, {"begin", "schema", "end"})
        schema = obj.get("schema")
        if isinstance(schema, str):  # xgrammar's legacy items also take the schema as JSON text
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as exc:
                raise RequestError(f"{where}.schema", f"is not valid JSON: {exc}") from None
        content = _Json(_schema(schema, f"{where}.schema"))
        tags.append(_Tag(_string(obj, "begin", where), content, (_string(obj, "end", where),), where))
    return _TriggeredTags(triggers, tuple(tags), False, False, (), path)


def _parse(value: Any, path: str, depth: int) -> _Format:
    if depth > MAX_DEPTH:
        raise RequestError(path, f"formats nest more than {MAX_DEPTH} deep")
    obj = _object(value, path)
    kind = obj.get("type")
    if kind == "const_string":
        _only_keys(obj, path, {"type", "value"})
        return _Const(_string(obj, "value", path))
    if kind == "json_schema":
        _only_keys(obj, path, {"type", "json_schema", "style", "any_order", "max_whitespace_cnt"})
        _default_only(obj, path, style="json", any_order=False, max_whitespace_cnt=None)
        return _Json(_schema(obj.get("json_schema"), f"{path}.json_schema"))
    if kind == "any_text":
        _only_keys(obj, path, {"type", "excludes", "max_tokens", "max_chars"})
        _default_only(obj, path, max_tokens=None, max_chars=None)
        return _AnyText(_strings(obj, "excludes", path), path)
    if kind in ("sequence", "or"):
        _only_keys(obj, path, {"type", "elements"})
        items = obj.get("elements")
        if not isinstance(items, list) or not items:
            raise RequestError(f"{path}.elements", "must be a non-empty list of formats")
        elements = tuple(_parse(e, f"{path}.elements[{i}]", depth + 1) for i, e in enumerate(items))
        return _Sequence(elements) if kind == "sequence" else _Or(elements)
    if kind == "tag":
        return _parse_tag(obj, path, depth)
    if kind in ("triggered_tags", "tags_with_separator"):
        triggered = kind == "triggered_tags"
        _only_keys(obj, path, {"type", "tags", "at_least_one", "stop_after_first",
                               *(("triggers", "excludes") if triggered else ("separator",))})
        items = obj.get("tags")
        if not isinstance(items, list) or not items:
            raise RequestError(f"{path}.tags", "must be a non-empty list of tags")
        tags = tuple(_parse_tag(_object(t, f"{path}.tags[{i}]"), f"{path}.tags[{i}]", depth + 1)
                     for i, t in enumerate(items))
        flags = _bool(obj, "at_least_one", path), _bool(obj, "stop_after_first", path)
        if triggered:
            triggers = _strings(obj, "triggers", path, required=True)
            return _TriggeredTags(triggers, tags, *flags, _strings(obj, "excludes", path), path)
        return _TagsWithSeparator(tags, _string(obj, "separator", path), *flags)
    if not isinstance(kind, str):
        raise RequestError(f"{path}.type", "must be a string naming the format")
    raise RequestError(f"{path}.type", f"{kind!r} is not supported; supported: const_string, json_schema, "
                                       "any_text, sequence, or, tag, triggered_tags, tags_with_separator")


def _parse_tag(obj: dict[str, Any], path: str, depth: int) -> _Tag:
    # NOTE: the type may be left out where only a tag fits (the tags of triggered_tags, as smg sends them)
    _only_keys(obj, path, {"type", "begin", "content", "end"})
    if obj.get("type", "tag") != "tag":
        raise RequestError(f"{path}.type", f"must be 'tag', got {obj.get('type')!r}")
    begin = obj.get("begin")
    if not isinstance(begin, str):
        raise RequestError(f"{path}.begin", "must be a string (token begins are not supported)")
    end = obj.get("end")
    if isinstance(end, str):
        ends: tuple[str, ...] = (end,)
    elif isinstance(end, list) and end and all(isinstance(e, str) for e in end):
        ends = tuple(dict.fromkeys(end))
    else:
        raise RequestError(f"{path}.end", "must be a string or a non-empty list of strings (token ends are "
                                          "not supported)")
    return _Tag(begin, _parse(obj.get("content"), f"{path}.content", depth + 1), ends, path)


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RequestError(path, f"must be a JSON object, got {type(value).__name__}")
    return value


def _only_keys(obj: dict[str, Any], path: str, allowed: set[str]) -> None:
    for key in obj:
        if key not in allowed:
            raise RequestError(f"{path}.{key}", "is not a known key here")


def _type_is(obj: dict[str, Any], path: str, kind: str) -> None:
    if obj.get("type", kind) != kind:
        raise RequestError(f"{path}.type", f"must be {kind!r}, got {obj.get('type')!r}")


def _default_only(obj: dict[str, Any], path: str, **defaults: Any) -> None:
    """Options of xgrammar's that this translation does not implement: accepted only at their defaults."""
    for key, default in defaults.items():
        if key in obj and obj[key] != default:
            raise RequestError(f"{path}.{key}", f"only {json.dumps(default)} is supported, got "
                                                f"{json.dumps(obj[key])}")


def _string(obj: dict[str, Any], key: str, path: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{path}.{key}", "must be a string")
    return value


def _strings(obj: dict[str, Any], key: str, path: str, *, required: bool = False) -> tuple[str, ...]:
    value = obj.get(key, None if required else [])
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise RequestError(f"{path}.{key}", "must be a list of non-empty strings")
    if required and not value:
        raise RequestError(f"{path}.{key}", "needs at least one string")
    return tuple(dict.fromkeys(value))


def _bool(obj: dict[str, Any], key: str, path: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise RequestError(f"{path}.{key}", "must be a boolean")
    return value


def _schema(value: Any, path: str) -> dict[str, Any]:
    """The schema with the server's JSON defaults (compact JSON) under what it asks for itself."""
    # NOTE: imported here: grammars.py imports this module
    from engine_server.engine.structured.grammars import JSON_DEFAULTS

    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise RequestError(path, "must be a JSON Schema (an object, or true)")
    guidance = value.get("x-guidance", {})
    if not isinstance(guidance, dict):
        raise RequestError(f"{path}.x-guidance", "must be an object")
    return {**value, "x-guidance": {**JSON_DEFAULTS, **guidance}}


# 2) formats -> Lark

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

    def expr(self, fmt: _Format, follow: _Follow, ends: tuple[str, ...]) -> str:
        """`fmt` then `follow`. `ends`: the end strings of the nearest tag around it, which free text anywhere
        inside that tag cannot contain (xgrammar's rule)."""
        then = _choice([_lit(s) for s in follow.literals])
        if isinstance(fmt, _Const):
            return _join(_opt_lit(fmt.value), then)
        if isinstance(fmt, _Json):
            return _join(self._json(fmt.schema), then)
        if isinstance(fmt, _AnyText):
            return self._free_text(fmt.excludes + ends, follow, fmt.path, what="any_text")
        if isinstance(fmt, _Or):
            return _choice([self.expr(e, follow, ends) for e in fmt.elements])
        if isinstance(fmt, _Sequence):
            return self._sequence(fmt, follow, ends)
        if isinstance(fmt, _Tag):
            return _join(self._tag(fmt), then)
        if isinstance(fmt, _TriggeredTags):
            return self._triggered(fmt, follow, ends)
        tags = _choice([self._tag(t) for t in fmt.tags])
        more = f"({_join(_opt_lit(fmt.separator), tags)})*" if not fmt.stop_after_first else ""
        body = _join(tags, more)
        return _join(body if fmt.at_least_one else f"({body})?", then)

    def _sequence(self, fmt: _Sequence, follow: _Follow, ends: tuple[str, ...]) -> str:
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

    def _tag(self, tag: _Tag) -> str:
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

    def _triggered(self, fmt: _TriggeredTags, follow: _Follow, ends: tuple[str, ...]) -> str:
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


def _ends_in_text(fmt: _Format) -> bool:
    """Whether free text ends the format (so it must know what stops it)."""
    if isinstance(fmt, _AnyText):
        return True
    if isinstance(fmt, _TriggeredTags):
        return not (fmt.at_least_one and fmt.stop_after_first)
    if isinstance(fmt, _Sequence):
        return _ends_in_text(fmt.elements[-1])
    if isinstance(fmt, _Or):
        return any(_ends_in_text(e) for e in fmt.elements)
    return False


def _leading_literal(fmt: _Format) -> str | None:
    """The string every match of `fmt` starts with, where the format says so outright."""
    if isinstance(fmt, _Const | _Tag):
        head = fmt.value if isinstance(fmt, _Const) else fmt.begin
        return head or None
    if isinstance(fmt, _Sequence):
        return _leading_literal(fmt.elements[0])
    return None


def _without_head(fmt: _Format, size: int) -> _Format:
    """`fmt` less the first `size` characters of its leading literal (free text before it matched them)."""
    if isinstance(fmt, _Const):
        return _Const(fmt.value[size:])
    if isinstance(fmt, _Tag):
        return replace(fmt, begin=fmt.begin[size:])
    assert isinstance(fmt, _Sequence)
    return _Sequence((_without_head(fmt.elements[0], size), *fmt.elements[1:]))


def _overlap(a: str, b: str) -> bool:
    """Whether one string contains the other, or one's end is the other's start."""
    return (a in b or b in a or any(a.endswith(b[:k]) for k in range(1, len(b)))
            or any(b.endswith(a[:k]) for k in range(1, len(a))))
