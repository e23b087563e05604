"""JSON Schema constraints: the server's compile options and the text -> grammar step.

NOTE: compact JSON by default: with flexible whitespace a model (a weak one above all) can spend its whole
budget on spaces and newlines between two tokens, and the output is still "valid" JSON that never closes.
A schema opts back in with llguidance's own "x-guidance": {"whitespace_flexible": true}.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import llguidance

from engine_server.engine.types import RequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


def json_schema_grammar(field_name: str, text: str) -> str:
    """The grammar of a schema given as JSON text.

    NOTE: the text goes to llguidance as it is (parsed in Rust): parsing a large schema into Python objects
    here would hold the GIL, which the step loop needs, for milliseconds.
    """
    stripped = text.strip()
    if stripped in ("true", "false"):  # JSON Schema's boolean schemas: anything, or nothing at all
        if stripped == "false":
            raise RequestError(field_name, "is false: it allows no output at all")
        text = "{}"
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
    except ValueError as exc:
        if "Expecting object schema" in str(exc):
            raise RequestError(field_name, "must be a JSON object (a schema), or true") from None
        raise RequestError(field_name, f"is not valid JSON: {exc}") from None


def schema_with_defaults(value: Any, path: str) -> dict[str, Any]:
    """A schema (parsed) with the server's compile options under what it asks for itself (in a larger grammar,
    where llguidance applies no defaults of ours)."""
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise RequestError(path, "must be a JSON Schema (an object, or true)")
    guidance = value.get("x-guidance", {})
    if not isinstance(guidance, dict):
        raise RequestError(f"{path}.x-guidance", "must be an object")
    return {**value, "x-guidance": {**JSON_DEFAULTS, **guidance}}
