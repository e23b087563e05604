"""A StructuredOutput -> the llguidance grammar that enforces it (a JSON string llguidance's LLMatcher reads).

Pure translation: nothing here compiles the grammar (compiler.py does, off the step loop), so these functions
are cheap; they raise RequestError for what is malformed before the library sees it (a schema that is not
JSON, a structural tag of the wrong shape).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

from engine_server.engine.structured.structural_tag import grammar_of_structural_tag_json
from engine_server.engine.types import RequestError, StructuredOutput, StructuredOutputKind

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# NOTE: compact JSON by default: with flexible whitespace a model (a weak one above all) can spend its whole
# budget on spaces and newlines between two tokens, and the output is still "valid" JSON that never closes.
# A schema opts back in with llguidance's own "x-guidance": {"whitespace_flexible": true}.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


def parse_json_schema(field_name: str, text: str) -> Any:
    """The schema as Python data; a schema is an object (or a boolean, JSON Schema's trivial ones)."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise RequestError(field_name, f"is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(field_name, f"must be a JSON object (a schema), got {type(schema).__name__}")
    return schema


def json_schema_grammar(field_name: str, schema: Any) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    except ValueError as exc:
        raise RequestError(field_name, str(exc)) from None


def lark_string(text: str) -> str:
    """A Lark string literal matching exactly `text`."""
    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: tuple[str, ...]) -> str:
    alternatives = " | ".join(lark_string(c) for c in dict.fromkeys(choices))
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")


def grammar_of(constraint: StructuredOutput) -> str:
    """The llguidance grammar for a constraint. Raises RequestError (naming constraint.field_name)."""
    name = constraint.field_name or constraint.kind.value
    kind = constraint.kind
    if kind is StructuredOutputKind.JSON_SCHEMA:
        return json_schema_grammar(name, parse_json_schema(name, constraint.spec))
    if kind is StructuredOutputKind.JSON_OBJECT:
        return json_schema_grammar(name, {"type": "object"})
    if kind is StructuredOutputKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    if kind is StructuredOutputKind.GRAMMAR:
        return llguidance.LLMatcher.grammar_from_lark(constraint.spec)
    if kind is StructuredOutputKind.CHOICE:
        return choice_grammar(constraint.choices)
    if kind is StructuredOutputKind.STRUCTURAL_TAG:
        tags = []
        for i, tag in enumerate(constraint.tags):
            schema: Any = True
            if tag.json_schema.strip():
                schema = parse_json_schema(f"{name}.tags[{i}].json_schema", tag.json_schema)
            trigger = next(t for t in constraint.triggers if tag.begin.startswith(t))  # checked at the edge
            tags.append(llguidance.StructTag(trigger=trigger, begin=tag.begin, grammar=schema, end=tag.end))
        return llguidance.LLMatcher.grammar_from_lark(llguidance.StructTag.to_grammar(tags))
    if kind is StructuredOutputKind.STRUCTURAL_TAG_JSON:
        return grammar_of_structural_tag_json(name, constraint.spec)
    raise RequestError(name, f"unsupported constraint kind {kind.value!r}")
