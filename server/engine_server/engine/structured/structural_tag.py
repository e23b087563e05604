"""Structural tags as JSON (what the vLLM-compatible service receives) -> an llguidance grammar.

Two forms arrive. vLLM's legacy one, {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, is
xgrammar's `triggered_tags` (xgrammar itself converts it so), and xgrammar's own, {"type": "structural_tag",
"format": FORMAT}, is a tree of formats. Both go one way: JSON -> the formats of tag_lark.py (every error
names its JSON path) -> a Lark grammar in llguidance's dialect (tag_lark.py). engine.v1's StructuralTag is the
legacy form as a message.
"""

from __future__ import annotations

import json
from typing import Any

from engine_server.engine.structured.json_schema import schema_with_defaults
from engine_server.engine.structured.tag_lark import (
    AnyText,
    Const,
    Format,
    Json,
    Or,
    Sequence,
    Tag,
    TagsWithSeparator,
    TriggeredTags,
    grammar_of_format,
)
from engine_server.engine.types import RequestError, StructuralTagItem

MAX_DEPTH = 32  # nesting of formats; deeper trees are refused


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
    return grammar_of_format(root)


def grammar_of_structural_tag(field_name: str, tags: tuple[StructuralTagItem, ...], triggers: tuple[str, ...]
                              ) -> str:
    """engine.v1's StructuralTag (vLLM's legacy form as a message); RequestError names the message field."""
    items = []
    for i, item in enumerate(tags):
        where = f"{field_name}.tags[{i}]"
        schema: Any = True
        if item.json_schema.strip():
            try:
                schema = json.loads(item.json_schema)
            except (ValueError, RecursionError) as exc:
                raise RequestError(f"{where}.json_schema", f"is not valid JSON: {exc}") from None
        content = Json(schema_with_defaults(schema, f"{where}.json_schema"))
        items.append(Tag(item.begin, content, (item.end,), where))
    return grammar_of_format(TriggeredTags(triggers, tuple(items), False, False, (), field_name))


# 1) JSON -> formats

def _parse_legacy(top: dict[str, Any], path: str) -> TriggeredTags:
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
        content = Json(schema_with_defaults(schema, f"{where}.schema"))
        tags.append(Tag(_string(obj, "begin", where), content, (_string(obj, "end", where),), where))
    return TriggeredTags(triggers, tuple(tags), False, False, (), path)


def _parse(value: Any, path: str, depth: int) -> Format:
    if depth > MAX_DEPTH:
        raise RequestError(path, f"formats nest more than {MAX_DEPTH} deep")
    obj = _object(value, path)
    kind = obj.get("type")
    if kind == "const_string":
        _only_keys(obj, path, {"type", "value"})
        return Const(_string(obj, "value", path))
    if kind == "json_schema":
        _only_keys(obj, path, {"type", "json_schema", "style", "any_order", "max_whitespace_cnt"})
        _default_only(obj, path, style="json", any_order=False, max_whitespace_cnt=None)
        return Json(schema_with_defaults(obj.get("json_schema"), f"{path}.json_schema"))
    if kind == "any_text":
        _only_keys(obj, path, {"type", "excludes", "max_tokens", "max_chars"})
        _default_only(obj, path, max_tokens=None, max_chars=None)
        return AnyText(_strings(obj, "excludes", path), path)
    if kind in ("sequence", "or"):
        _only_keys(obj, path, {"type", "elements"})
        items = obj.get("elements")
        if not isinstance(items, list) or not items:
            raise RequestError(f"{path}.elements", "must be a non-empty list of formats")
        elements = tuple(_parse(e, f"{path}.elements[{i}]", depth + 1) for i, e in enumerate(items))
        return Sequence(elements) if kind == "sequence" else Or(elements)
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
            return TriggeredTags(triggers, tags, *flags, _strings(obj, "excludes", path), path)
        return TagsWithSeparator(tags, _string(obj, "separator", path), *flags)
    if not isinstance(kind, str):
        raise RequestError(f"{path}.type", "must be a string naming the format")
    raise RequestError(f"{path}.type", f"{kind!r} is not supported; supported: const_string, json_schema, "
                                       "any_text, sequence, or, tag, triggered_tags, tags_with_separator")


def _parse_tag(obj: dict[str, Any], path: str, depth: int) -> Tag:
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
    return Tag(begin, _parse(obj.get("content"), f"{path}.content", depth + 1), ends, path)


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



