"""Hypothesis strategies for protobuf messages of any type, built from the message's descriptor.

A fuzzed request is a valid base request with a random subset of fields overwritten (`overlay`): a message
drawn field by field from nothing is rejected at its first check, so the deep paths (scheduling, sampling,
detokenizing, streaming) would never see the odd values. Values lean towards the edges where bugs live:
0, 1, the type's limits, NaN and infinities, empty and long strings, token ids just past the vocabulary.
`grpc_message` frames a message for the wire, its flag and length honest or not.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any, Literal, TypeVar, cast

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

M = TypeVar("M", bound=Message)

_INT_LIMITS = {
    FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_FIXED32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1),
    FieldDescriptor.TYPE_FIXED64: (0, (1 << 64) - 1),
}
_FLOAT32_MAX = 3.4028234663852886e38
_LENGTH_DELIMITED = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)


def grpc_message(body: bytes, *, is_compressed: int = 0, length: int | None = None) -> bytes:
    """A gRPC length-prefixed message; the flag byte and the length may lie."""
    return struct.pack(">BI", is_compressed, len(body) if length is None else length) + body


def _integers(low: int, high: int, small: int) -> st.SearchStrategy[int]:
    """Small values (counts, token ids near a small vocabulary) most of the time, the limits sometimes."""
    candidates = (low, high, high - 1, 0, 1, -1, 2, small - 1, small, small + 1)
    edges = sorted({v for v in candidates if low <= v <= high})
    return st.one_of(
        st.integers(max(low, -small), min(high, small)),
        st.sampled_from(edges),
        st.integers(low, high),
    )


def _floats(is_double: bool) -> st.SearchStrategy[float]:
    width: Literal[32, 64] = 64 if is_double else 32
    return st.one_of(
        st.floats(-3.0, 3.0, width=width),
        st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-9, 100.0, math.inf, -math.inf, math.nan, _FLOAT32_MAX]),
        st.floats(width=width),
    )


def _text() -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "\x00", "user", "a" * 5000]))


def scalar_values(field: FieldDescriptor, small: int) -> st.SearchStrategy[Any]:
    """Values a field of this scalar or enum type can hold on the wire."""
    kind = field.type
    if kind in _INT_LIMITS:
        return _integers(*_INT_LIMITS[kind], small=small)
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return _floats(kind == FieldDescriptor.TYPE_DOUBLE)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return _text()
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=16)
    if kind == FieldDescriptor.TYPE_ENUM:  # open enums: numbers no version of the contract names as well
        assert field.enum_type is not None
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-2, max(known) + 2))
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


class MessageFuzzer:
    """Draws messages of one type: each field set with probability ~1/3, nested messages to `depth`.

    `small` bounds the usual magnitude of integers (e.g. a little over the model's vocabulary, so ids
    straddle its end); `max_repeated` the usual length of a repeated field (a long one is drawn now and then).
    """

    def __init__(self, *, small: int = 1100, max_repeated: int = 6, long_repeated: int = 3000,
                 depth: int = 4) -> None:
        self.small = small
        self.max_repeated = max_repeated
        self.long_repeated = long_repeated
        self.depth = depth

    def messages(self, message_type: type[M]) -> st.SearchStrategy[M]:
        descriptor = cast(Descriptor, message_type.DESCRIPTOR)  # upb's class: apart in the stubs
        return self._message(descriptor, self.depth).map(
            lambda fields: self._build(message_type, fields))

    def overlay(self, base: Callable[[], M]) -> st.SearchStrategy[M]:
        """A fresh `base()` with a fuzzed message of its type merged over it (set fields replace, repeated
        fields append)."""
        def merged(fuzz: M) -> M:
            message = base()
            message.MergeFrom(fuzz)
            return message
        return self.messages(type(base())).map(merged)

    # Messages are drawn as dicts of field values, then built: hypothesis shrinks plain data well.

    def _message(self, descriptor: Descriptor, depth: int) -> st.SearchStrategy[dict[str, Any]]:
        parts: dict[str, st.SearchStrategy[Any]] = {}
        in_oneof = {f.name for oneof in descriptor.oneofs for f in oneof.fields
                    if not oneof.name.startswith("_")}  # proto3 `optional` fields are synthetic oneofs
        for field in descriptor.fields:
            if field.name in in_oneof:
                continue
            value = self._field(field, depth)
            if value is not None:
                parts[field.name] = st.one_of(st.none(), st.none(), value)
        for oneof in descriptor.oneofs:
            if oneof.name.startswith("_"):
                continue
            choices = [st.tuples(st.just(f.name), v) for f in oneof.fields
                       if (v := self._field(f, depth)) is not None]
            parts[f"oneof:{oneof.name}"] = st.one_of(st.none(), *choices)
        return st.fixed_dictionaries(parts)

    def _field(self, field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any] | None:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key = scalar_values(field.message_type.fields_by_name["key"], self.small)
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                return None if depth <= 0 else st.dictionaries(
                    key, self._message(value_field.message_type, depth - 1), max_size=self.max_repeated)
            return st.dictionaries(key, scalar_values(value_field, self.small), max_size=self.max_repeated)
        if field.message_type is not None:
            if depth <= 0:
                return None
            one: st.SearchStrategy[Any] = self._message(field.message_type, depth - 1)
        else:
            one = scalar_values(field, self.small)
        if not field.is_repeated:
            return one
        if field.message_type is None and field.type not in _LENGTH_DELIMITED:
            # long packed lists: prompts over the model's length, huge stop-id lists
            return st.one_of(st.lists(one, max_size=self.max_repeated),
                             st.lists(one, min_size=self.long_repeated, max_size=self.long_repeated))
        return st.lists(one, max_size=self.max_repeated)

    def _build(self, message_type: type[M], fields: dict[str, Any]) -> M:
        message = message_type()
        _fill(message, fields)
        return message


def _fill(message: Message, fields: dict[str, Any]) -> None:
    descriptor = message.DESCRIPTOR
    for name, value in fields.items():
        if value is None:
            continue
        if name.startswith("oneof:"):
            name, value = value
        field = descriptor.fields_by_name[name]
        target = getattr(message, name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_is_message = field.message_type.fields_by_name["value"].message_type is not None
            for key, item in value.items():
                if value_is_message:
                    _fill(target[key], item)
                else:
                    target[key] = item
        elif field.is_repeated:
            if field.message_type is not None:
                for item in value:
                    _fill(target.add(), item)
            else:
                target.extend(value)
        elif field.message_type is not None:
            target.SetInParent()
            _fill(target, value)
        else:
            setattr(message, name, value)
