"""Structured output (constrained decoding): the language every completion of a request must be in.

Pass one of these as ``structured_output=`` to ``generate`` / ``complete`` (or in :class:`GenerateParams`).
The server masks every token that cannot continue the language, so the output is in it whatever the model
prefers; a completion that reaches ``max_tokens`` first ends with ``FinishReason.LENGTH`` and is then an
incomplete prefix. An invalid constraint is an ``InvalidRequestError`` naming the field, e.g.
``structured_output.regex: ... unclosed group``.

Example::

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    result = client.complete("Is water wet?", max_tokens=32, structured_output=JsonSchema(schema))
    answer = json.loads(result.text)["answer"]
    color = client.complete("Pick one:", max_tokens=8, structured_output=Choice(["red", "green"])).text

Only types are checked here (and that a schema given as Python data serializes to JSON); the server checks
the rest (an empty regex, a choice list without choices, a schema keyword it cannot enforce, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

__all__ = [
    "Choice",
    "Grammar",
    "JsonObject",
    "JsonSchema",
    "Regex",
    "Schema",
    "StructuralTag",
    "StructuredOutput",
    "Tag",
]

#: A JSON Schema as Python data (a dict, or JSON Schema's trivial ``True`` / ``False``) or as JSON text.
Schema: TypeAlias = Mapping[str, object] | bool | str


def _schema_text(name: str, schema: Schema) -> str:
    """The schema as JSON text: a str is sent as it is; Python data is serialized (compact)."""
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, Mapping | bool):
        raise TypeError(f"{name} must be a mapping, a bool or a JSON string, got {type(schema).__name__}")
    try:
        # NOTE: allow_nan=False: NaN and Infinity are not JSON; the server would refuse the whole schema.
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name} does not serialize to JSON: {exc}") from None


def _check_str(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")


def _str_tuple(name: str, values: Sequence[str]) -> tuple[str, ...]:
    # NOTE: a bare str is a Sequence[str] too; taking its characters as the list is never what was meant.
    if isinstance(values, str):
        raise TypeError(f"{name} must be a sequence of str, not a str (wrap it in a list)")
    items = tuple(values)
    for item in items:
        _check_str(f"{name}[]", item)
    return items


@dataclass(frozen=True, slots=True)
class JsonSchema:
    """JSON matching a JSON Schema (draft 2020-12; see generate.proto for the keywords the server enforces).

    ``schema`` is a dict (serialized with ``json.dumps`` when the object is made) or JSON text sent as it is;
    ``text`` is what goes on the wire. The output is compact JSON unless the schema's ``"x-guidance"`` object
    asks otherwise.
    """

    schema: Schema = field(compare=False)
    text: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", _schema_text("schema", self.schema))


@dataclass(frozen=True, slots=True)
class JsonObject:
    """Any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""


@dataclass(frozen=True, slots=True)
class Regex:
    """Text that matches ``pattern`` as a whole (Rust regex syntax, anchored at both ends; no lookaround)."""

    pattern: str

    def __post_init__(self) -> None:
        _check_str("pattern", self.pattern)


@dataclass(frozen=True, slots=True)
class Grammar:
    """Text in a context-free grammar in Lark syntax as llguidance reads it (``start`` is the start rule)."""

    lark: str

    def __post_init__(self) -> None:
        _check_str("lark", self.lark)


@dataclass(frozen=True, slots=True)
class Choice:
    """Exactly one of ``options`` (at least one, each non-empty)."""

    options: Sequence[str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", _str_tuple("options", self.options))


@dataclass(frozen=True, slots=True)
class Tag:
    """One tag of a :class:`StructuralTag`: ``begin``, then JSON matching ``schema``, then ``end``.

    ``schema`` None means any JSON value; like :class:`JsonSchema`'s, Python data is serialized and text is
    sent as it is (``text`` is what goes on the wire, "" for None).
    """

    begin: str
    schema: Schema | None = field(default=None, compare=False)
    end: str = ""
    text: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_str("begin", self.begin)
        _check_str("end", self.end)
        text = "" if self.schema is None else _schema_text("schema", self.schema)
        object.__setattr__(self, "text", text)


@dataclass(frozen=True, slots=True)
class StructuralTag:
    """Free text in which tool calls are constrained (the begin / schema / end form of vLLM and xgrammar).

    The text is free until it contains one of ``triggers``; from there it continues with the ``begin`` of a
    tag starting with that trigger, JSON matching the tag's schema, and the tag's ``end``; then it is free
    again. Every tag's ``begin`` must start with one of the triggers.

    Example: ``StructuralTag([Tag("<function=get_weather>", {"type": "object"}, "</function>")],
    triggers=["<function="])``
    """

    tags: Sequence[Tag]
    triggers: Sequence[str]

    def __post_init__(self) -> None:
        tags = tuple(self.tags)
        for tag in tags:
            if not isinstance(tag, Tag):
                raise TypeError(f"tags[] must be Tag, got {type(tag).__name__}")
        object.__setattr__(self, "tags", tags)
        object.__setattr__(self, "triggers", _str_tuple("triggers", self.triggers))


#: One constraint: what ``structured_output=`` takes.
StructuredOutput: TypeAlias = JsonSchema | JsonObject | Regex | Grammar | Choice | StructuralTag

STRUCTURED_OUTPUT_TYPES = (JsonSchema, JsonObject, Regex, Grammar, Choice, StructuralTag)
