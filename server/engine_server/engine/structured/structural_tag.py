"""Structural tags as JSON (what the vLLM-compatible service receives) -> an llguidance grammar."""

from __future__ import annotations

from engine_server.engine.types import RequestError


def grammar_of_structural_tag_json(field_name: str, text: str) -> str:
    raise RequestError(field_name, "structural tags as JSON are not supported yet")
