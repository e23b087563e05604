"""Languages for the structured-output tests, and checkers for their outputs that do not use llguidance.

Every language here is bounded (strings by maxLength / enum / pattern, arrays by maxItems, grammars by counted
repetition) so that a random-weight model, which only the constraint keeps on track, finishes well within the
tests' max_tokens.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
from typing import Any

import jsonschema
import regex  # type: ignore[import-untyped]  # (transformers' dependency, without type stubs)

# Each schema: (name, schema). Objects close their properties (additionalProperties: false) or bound them:
# llguidance lets an open object grow extra properties with any value, which need not end.
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("flat_object", {
        "$id": "https://example.com/person", "$comment": "annotations and unknown keys are ignored",
        "examples": [{"name": "Ada", "age": 36}], "default": {"name": "", "age": 0}, "x-custom": {"a": 1},
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("optional_properties", {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                       "nickname": {"type": "string", "minLength": 1, "maxLength": 8},
                       "active": {"type": "boolean"},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["id"], "additionalProperties": False}),
    ("nested_objects", {
        "type": "object",
        "properties": {"user": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 10},
                           "address": {"type": "object",
                                       "properties": {"street": {"type": "string", "maxLength": 16},
                                                      "city": {"enum": ["Paris", "Oslo", "Lima", "Kyiv"]},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                       "required": ["street", "city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False}),
    ("bounded_integer_array", {
        "type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2,
        "maxItems": 4}),
    ("array_of_objects", {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object",
                  "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                 "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                  "required": ["x", "y"], "additionalProperties": False}}),
    ("exact_array_length", {
        "type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 3, "maxItems": 3}),
    ("nested_arrays", {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}}),
    ("tuple_prefix_items", {
        "type": "array",
        "prefixItems": [{"enum": ["add", "remove"]}, {"type": "integer", "minimum": 0, "maximum": 3},
                        {"type": "boolean"}],
        "items": False, "minItems": 3}),
    ("string_enum", {"enum": ["red", "green", "blue", "light blue"]}),
    ("mixed_enum", {"enum": [1, "two", None, True, 3.5, [1, 2], {"k": "v"}]}),
    ("const_fields", {
        "type": "object",
        "properties": {"version": {"const": "1.0"}, "kind": {"const": 42},
                       "tags": {"const": ["x", "y"]}, "note": {"type": "string", "maxLength": 6}},
        "required": ["version", "kind", "tags", "note"], "additionalProperties": False}),
    ("any_of_scalars", {
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4},
                  {"type": "null"}]}),
    ("one_of_shapes", {
        "oneOf": [
            {"type": "object",
             "properties": {"shape": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1,
                                                                      "maximum": 10}},
             "required": ["shape", "radius"], "additionalProperties": False},
            {"type": "object",
             "properties": {"shape": {"const": "rect"}, "w": {"type": "integer", "minimum": 1, "maximum": 10},
                            "h": {"type": "integer", "minimum": 1, "maximum": 10}},
             "required": ["shape", "w", "h"], "additionalProperties": False}]}),
    ("type_list", {
        "type": "object",
        "properties": {"value": {"type": ["integer", "null"], "minimum": -3, "maximum": 3},
                       "label": {"type": ["string", "boolean"], "maxLength": 5}},
        "required": ["value", "label"], "additionalProperties": False}),
    ("refs_and_defs", {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 50},
                                           "y": {"type": "integer", "minimum": 0, "maximum": 50}},
                            "required": ["x", "y"], "additionalProperties": False},
                  "color": {"enum": ["red", "black"]}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"},
                       "color": {"$ref": "#/$defs/color"}},
        "required": ["start", "end", "color"], "additionalProperties": False}),
    ("any_of_refs", {
        "$defs": {"cat": {"type": "object", "properties": {"meows": {"type": "boolean"}},
                          "required": ["meows"], "additionalProperties": False},
                  "dog": {"type": "object", "properties": {"barks": {"type": "integer", "minimum": 0,
                                                                     "maximum": 5}},
                          "required": ["barks"], "additionalProperties": False}},
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"anyOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}]}}),
    ("all_of", {
        "allOf": [{"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 100},
                                  "b": {"type": "boolean"}},
                   "required": ["a", "b"], "additionalProperties": False},
                  {"properties": {"a": {"maximum": 10}}}]}),
    ("string_pattern", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}(-[a-z]{1,3})?$"}),
    ("string_lengths", {"type": "string", "minLength": 3, "maxLength": 6}),
    ("format_date", {"type": "object", "properties": {"born": {"type": "string", "format": "date"}},
                     "required": ["born"], "additionalProperties": False}),
    ("format_date_time", {"type": "string", "format": "date-time"}),
    ("format_time", {"type": "string", "format": "time"}),
    ("format_email", {"type": "string", "format": "email", "maxLength": 24}),
    ("format_uuid", {"type": "string", "format": "uuid"}),
    ("format_ipv4", {"type": "string", "format": "ipv4"}),
    ("format_ipv6", {"type": "string", "format": "ipv6"}),
    ("format_hostname", {"type": "string", "format": "hostname", "maxLength": 40}),
    ("integer_bounds", {"type": "integer", "minimum": -20, "maximum": 20}),
    ("integer_exclusive_bounds", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    ("number_bounds", {"type": "number", "minimum": -1.5, "maximum": 2.5}),
    ("number_exclusive_bounds", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    ("multiple_of", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
    ("booleans_and_null", {
        "type": "object",
        "properties": {"flag": {"type": "boolean"}, "nothing": {"type": "null"},
                       "list": {"type": "array", "items": {"type": "null"}, "maxItems": 2}},
        "required": ["flag", "nothing", "list"], "additionalProperties": False}),
    ("pattern_properties", {
        "type": "object", "patternProperties": {"^x_[a-z]{1,3}$": {"type": "integer", "minimum": 0,
                                                                   "maximum": 9}},
        "additionalProperties": False, "maxProperties": 3}),
    ("order", {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "an order", "description": "annotations are ignored",
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "status": {"enum": ["new", "paid", "shipped"]},
            "lines": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "object",
                                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                               "qty": {"type": "integer", "minimum": 1, "maximum": 10},
                                               "price": {"type": "integer", "minimum": 0, "maximum": 999}},
                                "required": ["sku", "qty"], "additionalProperties": False}},
            "note": {"type": "string", "maxLength": 10}},
        "required": ["id", "status", "lines"], "additionalProperties": False}),
    ("min_properties_one", {
        "type": "object", "minProperties": 1, "additionalProperties": False,
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}}}),
    ("max_properties_one", {
        "type": "object", "maxProperties": 1, "additionalProperties": False,
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}}}),
    ("top_level_boolean", {"type": "boolean"}),
    ("top_level_null", {"type": "null"}),
]


_HOUR = "([01][0-9]|2[0-3])"
_TIME = rf"{_HOUR}:[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]{_HOUR}:[0-5][0-9])"


def _is_time(text: object) -> bool:
    """RFC 3339 full-time (a leap second allowed, as RFC 3339 does)."""
    return not isinstance(text, str) or re.fullmatch(_TIME, text) is not None


def _is_date(text: str) -> bool:
    if re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text) is None:
        return False
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


def _is_date_time(text: object) -> bool:
    if not isinstance(text, str):
        return True
    date, sep, time = text[:10], text[10:11], text[11:]
    return sep in ("T", "t") and _is_date(date) and _is_time(time)


_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"


def _is_hostname(text: object) -> bool:
    """RFC 1123: dot-separated labels of 1-63 letters, digits and inner hyphens; at most 253 characters."""
    if not isinstance(text, str):
        return True
    return len(text) <= 253 and re.fullmatch(rf"{_LABEL}(\.{_LABEL})*", text) is not None


_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"


def _is_email(text: object) -> bool:
    """RFC 5321 mailbox: a dot-atom or quoted local part, @, a host name or an address literal."""
    if not isinstance(text, str):
        return True
    local, at, domain = text.rpartition("@")
    if not at:
        return False
    is_local = (re.fullmatch(rf"{_ATEXT}(\.{_ATEXT})*", local) is not None
                or re.fullmatch(r'"([\x20\x21\x23-\x5b\x5d-\x7e]|\\[\x20-\x7e])*"', local) is not None)
    if domain.startswith("[") and domain.endswith("]"):
        literal = domain[1:-1].removeprefix("IPv6:")
        try:
            ipaddress.ip_address(literal)
        except ValueError:
            return False
        return is_local
    return is_local and _is_hostname(domain)


def format_checker() -> jsonschema.FormatChecker:
    """jsonschema's format checks (date, uuid, ipv4, ipv6, ...) and ours for the formats whose checks need
    packages we do not install (date-time, time, hostname) or that jsonschema checks loosely (email: "@")."""
    checker = jsonschema.FormatChecker()
    checker.checks("date-time")(_is_date_time)
    checker.checks("time")(_is_time)
    checker.checks("hostname")(_is_hostname)
    checker.checks("email")(_is_email)
    return checker


def schema_errors(schema: dict[str, Any], text: str) -> list[str]:
    """Why `text` is not a JSON document valid under `schema` (empty if it is)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return [f"not JSON: {exc}"]
    validator = jsonschema.Draft202012Validator(schema, format_checker=format_checker())
    return [error.message for error in validator.iter_errors(value)]


# Regular expressions (Rust syntax, as llguidance reads them), checked with regex_fullmatch.
REGEXES: list[tuple[str, str]] = [
    ("iso_date", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("email", r"[a-z0-9._%+-]{1,12}@[a-z0-9-]{1,10}(\.[a-z]{2,4}){1,2}"),
    ("identifier", r"[A-Za-z_][A-Za-z0-9_]{0,15}"),
    ("ipv4", r"((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}"
             r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"),
    ("phone", r"\+[0-9]{1,3} \([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("hex_color", r"#[0-9a-fA-F]{6}"),
    ("clock_time", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("semver", r"(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})(-(alpha|beta|rc)\.[0-9])?"),
    ("alternation", r"(cat|dog|bird|fish)s? (runs|sleeps)"),
    ("greek_word", r"[\u03b1-\u03c9]{3,8}"),  # alpha to omega
    ("unicode_digits", r"\d{3}-\d{2}"),
    ("word_chars", r"\w{2,10}"),
    ("open_ended_letters", r"[a-z]{1,40}"),
    ("quoted_csv", r'"[a-z]{1,5}"(,"[a-z]{1,5}"){0,3}'),
]

# NOTE: Rust's \d and \w are Unicode classes (UTS #18), and not quite Python's: Rust's \w has the marks (a
# variation selector, category Mn, is a word character), and Rust's tables are newer than Python 3.11's
# unicodedata (Unicode 14). So they are checked as the regex module's Unicode properties.
_RUST_CLASSES = {r"\d": r"\p{Nd}", r"\w": r"[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}]"}


def regex_fullmatch(pattern: str, text: str) -> bool:
    r"""Whether all of `text` matches `pattern` (Rust syntax, its \d and \w outside brackets)."""
    for rust, ours in _RUST_CLASSES.items():
        pattern = pattern.replace(rust, ours)
    return regex.fullmatch(pattern, text) is not None


# Lark grammars (llguidance's dialect). Recursion and repetition are bounded: a random model only stops
# where the grammar makes it.
ARITHMETIC_GRAMMAR = r"""
start: expr
expr: term (ADDOP term){0,2}
term: factor (MULOP factor){0,2}
factor: NUMBER | "(" inner ")" | "-" NUMBER
inner: iterm (ADDOP iterm){0,2}
iterm: NUMBER (MULOP NUMBER){0,1}
ADDOP: "+" | "-"
MULOP: "*" | "/"
NUMBER: /0|[1-9][0-9]{0,2}/
"""

SQL_GRAMMAR = r"""
start: "SELECT " columns " FROM " TABLE where? order? ";"
columns: "*" | COLUMN (", " COLUMN){0,3}
where: " WHERE " condition (LOGIC condition){0,2}
condition: COLUMN " " OP " " value
order: " ORDER BY " COLUMN DIRECTION?
DIRECTION: " ASC" | " DESC"
LOGIC: " AND " | " OR "
OP: "=" | "<" | ">" | "<=" | ">=" | "!="
value: INT | STRING
COLUMN: /[a-z][a-z0-9_]{0,7}/
TABLE: /[a-z][a-z_]{0,9}/
INT: /0|[1-9][0-9]{0,3}/
STRING: /'[a-z ]{0,8}'/
"""


class _Cursor:
    """A recognizer's position in the text it checks."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def take(self, literal: str) -> bool:
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def expect(self, literal: str) -> None:
        if not self.take(literal):
            raise SyntaxError(f"expected {literal!r} at {self.pos}: {self.text!r}")

    def match(self, pattern: str) -> str:
        found = re.compile(pattern).match(self.text, self.pos)
        if found is None or not found.group():
            raise SyntaxError(f"expected /{pattern}/ at {self.pos}: {self.text!r}")
        self.pos = found.end()
        return found.group()

    def end(self) -> None:
        if self.pos != len(self.text):
            raise SyntaxError(f"trailing text at {self.pos}: {self.text!r}")


_NUMBER = r"0(?![0-9])|[1-9][0-9]{0,2}(?![0-9])"


def _number(c: _Cursor) -> None:
    c.match(_NUMBER)


def _repeat(c: _Cursor, operators: str, operand: Any, most: int) -> None:
    operand(c)
    for _ in range(most):
        if not any(c.take(op) for op in operators):
            return
        operand(c)


def _factor(c: _Cursor) -> None:
    if c.take("("):
        _repeat(c, "+-", lambda c: _repeat(c, "*/", _number, 1), 2)
        c.expect(")")
    elif c.take("-"):
        _number(c)
    else:
        _number(c)


def check_arithmetic(text: str) -> None:
    """Recognizes ARITHMETIC_GRAMMAR's language (raises SyntaxError), then has Python parse it as the same
    expression: nothing but numbers, + - * /, unary minus and parentheses."""
    import ast

    c = _Cursor(text)
    _repeat(c, "+-", lambda c: _repeat(c, "*/", _factor, 2), 2)
    c.end()
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
               ast.USub)
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise SyntaxError(f"{type(node).__name__} in {text!r}")


_COLUMN = r"[a-z][a-z0-9_]{0,7}(?![a-z0-9_])"


def check_sql(text: str) -> None:
    """Recognizes SQL_GRAMMAR's language (raises SyntaxError)."""
    c = _Cursor(text)
    c.expect("SELECT ")
    if not c.take("*"):
        c.match(_COLUMN)
        for _ in range(3):
            if not c.take(", "):
                break
            c.match(_COLUMN)
    c.expect(" FROM ")
    c.match(r"[a-z][a-z_]{0,9}(?![a-z_])")
    if c.take(" WHERE "):
        for i in range(3):
            if i and not (c.take(" AND ") or c.take(" OR ")):
                break
            c.match(_COLUMN)
            c.expect(" ")
            c.match(r"<=|>=|!=|=|<|>")
            c.expect(" ")
            c.match(r"0(?![0-9])|[1-9][0-9]{0,3}(?![0-9])|'[a-z ]{0,8}'")
    if c.take(" ORDER BY "):
        c.match(_COLUMN)
        _ = c.take(" ASC") or c.take(" DESC")
    c.expect(";")
    c.end()


def is_compact_json(text: str) -> bool:
    """Whether a JSON text has no whitespace outside its strings (what the engine's JSON is by default)."""
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in " \t\r\n":
            return False
    return True


def slow_schema(tag: str) -> dict[str, Any]:
    """A schema (~39 KB) that takes llguidance most of a second to compile on a slow core: four properties,
    each an allOf of three anyOfs of 12 objects (an intersection of 1,728 objects; llguidance's parser
    takes at most 2,000 alternatives at once). `tag` (an annotation) makes it a schema of its own."""
    names = ["a", "b", "c"]

    def branch(group: int, low: int) -> dict[str, Any]:
        properties: dict[str, Any] = {name: {"type": "integer", "minimum": 0, "maximum": 99}
                                      for name in names}
        properties[names[group]] = {"type": "integer", "minimum": low, "maximum": low + 50}
        return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}

    value = {"allOf": [{"anyOf": [branch(group, low) for low in range(12)]} for group in range(3)]}
    fields = [f"p{i}" for i in range(4)]
    return {"title": tag, "type": "object", "properties": dict.fromkeys(fields, value), "required": fields,
            "additionalProperties": False}


def panicking_schema() -> dict[str, Any]:
    """A schema on which llguidance 1.9.1 panics while compiling (an intersection of 6,561 objects overflows
    its u16 symbol ids), after about a second on a slow core."""
    names = ["a", "b", "c", "d"]

    def branch(group: int, low: int) -> dict[str, Any]:
        properties: dict[str, Any] = {name: {"type": "integer", "minimum": 0, "maximum": 99}
                                      for name in names}
        properties[names[group]] = {"type": "integer", "minimum": low, "maximum": low + 50}
        return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}

    return {"allOf": [{"anyOf": [branch(group, low) for low in range(9)]} for group in range(4)]}
