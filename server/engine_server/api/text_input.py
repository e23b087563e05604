"""Requests' text on its way to token ids: refused unread when it cannot fit, tokenized off the event loop.

A text of more than N * `max_token_bytes` bytes has more than N tokens (frontend/tokenizer.py), so text that
cannot fit in the context (or in an embedding model's length) is refused from its size on the wire, before a
`str` is made of it: reading 4 MB of mixed-script text as a `str` costs ~10 ms of the event loop and 16 MB,
tokenizing it took seconds, only to refuse it for its length. What fits becomes a `Tokenization`, which the
servicers run on the engine's tokenizer pool (inline when short).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from engine_server.frontend.types import RequestError

_T = TypeVar("_T")

_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LEN, _WIRE_FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True, slots=True)
class Tokenization(Generic[_T]):
    """A request's text to tokenize, already checked where that is cheap: `run()` does the rest (read the
    text, render a conversation, tokenize, check the tokens). The servicers run it on the engine's tokenizer
    pool, which runs it inline when `size` is small."""

    run: Callable[[], _T]
    size: int  # the input's size: bytes of text (of a conversation's contents, for chat input)


def check_text_fits(num_bytes: int, *, field: str, max_tokens: int, max_token_bytes: int) -> None:
    """Refuses a text of `num_bytes` (UTF-8) that cannot fit in `max_tokens` tokens."""
    limit = max_tokens * max_token_bytes
    if num_bytes > limit:
        raise RequestError(field, f"{num_bytes} bytes of text cannot fit in {max_tokens} tokens (no token "
                                  f"stands for more than {max_token_bytes} bytes: at most {limit} bytes)")


def string_field_size(message: Any, name: str) -> int:
    """The UTF-8 size of the message's string field `name` (0 when unset), read off its encoding."""
    data = message.SerializeToString()
    number = message.DESCRIPTOR.fields_by_name[name].number
    size = 0
    for field, start, end in _fields(data):
        if field == number:
            size = end - start  # (the last occurrence is the one the parser kept)
    return size


def nested_string_sizes(message: Any, repeated: str, name: str) -> list[int]:
    """Per element of the repeated message field `repeated`: the UTF-8 size of its string field `name`."""
    data = message.SerializeToString()
    descriptor = message.DESCRIPTOR.fields_by_name[repeated]
    outer, inner = descriptor.number, descriptor.message_type.fields_by_name[name].number
    sizes = []
    for field, start, end in _fields(data):
        if field == outer:
            size = 0
            for nested, nested_start, nested_end in _fields(data, start, end):
                if nested == inner:
                    size = nested_end - nested_start
            sizes.append(size)
    return sizes


def _fields(data: bytes, start: int = 0, end: int | None = None) -> list[tuple[int, int, int]]:
    """(field number, payload start, payload end) of each length-delimited field in data[start:end].

    NOTE: only what the protobuf parser accepted reaches here (the message was parsed from these bytes'
    original), so the scan stops quietly at anything it does not know.
    """
    end = len(data) if end is None else end
    out = []
    pos = start
    while pos < end:
        tag, pos = _varint(data, pos)
        wire_type = tag & 7
        if wire_type == _WIRE_VARINT:
            _, pos = _varint(data, pos)
        elif wire_type == _WIRE_FIXED64:
            pos += 8
        elif wire_type == _WIRE_FIXED32:
            pos += 4
        elif wire_type == _WIRE_LEN:
            length, pos = _varint(data, pos)
            out.append((tag >> 3, pos, pos + length))
            pos += length
        else:
            break
    return out


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
    return value, pos
