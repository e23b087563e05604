"""Requests that set two members of one oneof are refused (INVALID_ARGUMENT), not cut to the last one unseen.

Protobuf's rule is "the last member on the wire wins": a client that sends both a JSON schema and a regex
would get one of them enforced and never know. The parsed message cannot tell (it holds one member), so the
wire bytes are read again, and only when they can hide a dropped member: re-encoding a message never makes it
larger than the client's encoding of the same content, and a dropped member makes it strictly smaller, so a
request whose `ByteSize()` equals its length (every request a protobuf library builds) costs one size check.
"""

from __future__ import annotations

from typing import Any, cast

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LEN, _WIRE_FIXED32 = 0, 1, 2, 5


class _Malformed(Exception):
    """Bytes the reader gives up on (the parser accepted them, so this is only a group or garbage it kept)."""


def oneof_conflict(message: Any, body: bytes) -> str | None:
    """"path: sets both a and b (members of one oneof)" when `body` sets two members of a oneof, else None."""
    # NOTE: upb messages only (the betterproto flavour, which embedders may serve, keeps no unknown members)
    if not isinstance(message, Message) or message.ByteSize() >= len(body):
        return None
    try:
        return _conflict_in(cast(Descriptor, message.DESCRIPTOR), body, "")
    except _Malformed:
        return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Malformed
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> list[tuple[int, bytes | None]]:
    """(field number, payload of a length-delimited field or None) for every field on the wire, in order."""
    out: list[tuple[int, bytes | None]] = []
    pos = 0
    while pos < len(data):
        tag, pos = _varint(data, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _WIRE_VARINT:
            _, pos = _varint(data, pos)
            out.append((number, None))
        elif wire_type == _WIRE_FIXED64:
            pos += 8
            out.append((number, None))
        elif wire_type == _WIRE_FIXED32:
            pos += 4
            out.append((number, None))
        elif wire_type == _WIRE_LEN:
            length, pos = _varint(data, pos)
            out.append((number, data[pos:pos + length]))
            pos += length
        else:
            raise _Malformed
        if pos > len(data):
            raise _Malformed
    return out


def _conflict_in(descriptor: Descriptor, data: bytes, path: str) -> str | None:
    fields = _fields(data)
    seen: dict[str, str] = {}  # oneof name -> the member set first
    merged: dict[int, bytes] = {}  # singular message fields: protobuf merges repeated occurrences
    for number, payload in fields:
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue
        oneof = field.containing_oneof
        if oneof is not None:
            first = seen.setdefault(oneof.name, field.name)
            if first != field.name:
                where = f"{path}{oneof.name}" if not path else f"{path}.{oneof.name}"
                return f"{where}: sets both {first} and {field.name} (members of one oneof; set exactly one)"
        sub = field.message_type
        if payload is None or sub is None or not _has_oneofs(sub):
            continue
        if field.is_repeated:  # each element its own message
            found = _conflict_in(sub, payload, f"{path}.{field.name}" if path else field.name)
            if found is not None:
                return found
        else:
            merged[number] = merged.get(number, b"") + payload
    for number, payload in merged.items():
        field = descriptor.fields_by_number[number]
        assert field.message_type is not None
        found = _conflict_in(field.message_type, payload, f"{path}.{field.name}" if path else field.name)
        if found is not None:
            return found
    return None


def _has_oneofs(descriptor: Descriptor, _depth: int = 0) -> bool:
    """Whether a message type or one nested in it has a oneof (the others need no walk). Bounded depth:
    recursive types are walked, never followed forever."""
    if descriptor.oneofs or _depth > 8:
        return bool(descriptor.oneofs) or _depth > 8
    return any(f.message_type is not None and _has_oneofs(f.message_type, _depth + 1)
               for f in descriptor.fields)
