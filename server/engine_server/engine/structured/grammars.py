"""A StructuredOutput -> the llguidance grammar that enforces it (a JSON string llguidance's LLMatcher reads).

Pure translation: nothing here compiles the grammar (compiler.py does, off the step loop), so these functions
are cheap; they raise RequestError for what is malformed before the library sees it (a schema that is not
JSON, a structural tag of the wrong shape).
"""

from __future__ import annotations

import json
import re

import llguidance

from engine_server.engine.structured.json_schema import json_schema_grammar
from engine_server.engine.structured.structural_tag import (
    grammar_of_structural_tag,
    grammar_of_structural_tag_json,
)
from engine_server.engine.types import RequestError, StructuredOutput, StructuredOutputKind

# A GBNF (llama.cpp) grammar defines `root` with `::=`; Lark (llguidance's dialect) has neither.
_GBNF_ROOT = re.compile(r"^[ \t]*root[ \t]*::=", re.MULTILINE)


def lark_grammar(field_name: str, text: str) -> str:
    """A grammar as the Lark that llguidance compiles: Lark as it is, GBNF (one that defines `root ::= ...`)
    converted by llguidance's gbnf_to_lark; what that converter does not take is refused.

    NOTE: the conversion is Python (~2 ms a KB): here it runs on a compile thread, not on a frontend's loop.
    """
    if not _GBNF_ROOT.search(text):
        return llguidance.LLMatcher.grammar_from_lark(text)
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(text))
    except Exception as exc:  # NOTE: GbnfToLarkError, or RecursionError for deep nesting
        raise RequestError(field_name, f"a GBNF grammar (it defines root ::=) that does not convert to Lark: "
                                       f"{exc}") from None


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
        return json_schema_grammar(name, constraint.spec)
    if kind is StructuredOutputKind.JSON_OBJECT:
        return json_schema_grammar(name, '{"type": "object"}')
    if kind is StructuredOutputKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    if kind is StructuredOutputKind.GRAMMAR:
        return lark_grammar(name, constraint.spec)
    if kind is StructuredOutputKind.CHOICE:
        return choice_grammar(constraint.choices)
    if kind is StructuredOutputKind.STRUCTURAL_TAG:
        return grammar_of_structural_tag(name, constraint.tags, constraint.triggers)
    if kind is StructuredOutputKind.STRUCTURAL_TAG_JSON:
        return grammar_of_structural_tag_json(name, constraint.spec)
    raise RequestError(name, f"unsupported constraint kind {kind.value!r}")
