"""How the fields of a secure-aggregation message travel: one codec per kind of header field and
the dtype / rank / row rules of an array field, declared on the message classes with
`wire_value(...)` / `wire_array(...)` and collected by `@wire_message` (see messages.py).

Every decode refuses what it cannot accept with MalformedMessage (a hostile header must never
make us allocate without limit or build a half-checked value).
"""

from __future__ import annotations

import abc
import base64
import binascii
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

import numpy as np

from .errors import MalformedMessage

# Upper bound on list fields, so a hostile header cannot make us allocate without limit.
MAX_LIST_ITEMS = 1 << 20

T = TypeVar("T")


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def unb64(value: Any, what: str, length: int | None = None) -> bytes:
    if not isinstance(value, str):
        raise MalformedMessage(f"{what} must be a base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedMessage(f"{what} is not valid base64") from None
    # only the canonical text (padded, unused bits zero): one value, one text, as the Java client
    # reads it (its decoder took a text without padding, and both took set unused bits)
    if b64(raw) != value:
        raise MalformedMessage(f"{what} is not canonical base64 (RFC 4648: padded, unused bits zero)")
    if length is not None and len(raw) != length:
        raise MalformedMessage(f"{what} must be {length} bytes, got {len(raw)}")
    return raw


def nonempty_str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise MalformedMessage(f"{what} must be a non-empty string (<= 256 chars)")
    return value


def str_list(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        raise MalformedMessage(f"{what} must be a list")
    items = tuple(nonempty_str(item, f"{what} item") for item in value)
    if len(set(items)) != len(items):
        raise MalformedMessage(f"{what} has duplicates")
    return items


def rows(value: Any, what: str, width: int) -> list[list[Any]]:
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        raise MalformedMessage(f"{what} must be a list")
    for row in value:
        if not isinstance(row, list) or len(row) != width:
            raise MalformedMessage(f"each {what} entry must be a list of {width} items")
    return value


class WireValue(abc.ABC):
    """How one header field travels: its JSON form and the checks that refuse a bad one."""

    @abc.abstractmethod
    def encode(self, value: Any) -> Any: ...

    @abc.abstractmethod
    def decode(self, raw: Any, name: str) -> Any:
        """The field's value from its JSON form; MalformedMessage when it is not acceptable."""

    def read(self, name: str, payload: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
             parsed: Mapping[str, Any]) -> Any:
        return self.decode(payload[name], name)


@dataclass(frozen=True)
class Base64Bytes(WireValue):
    length: int

    def encode(self, value: bytes) -> str:
        return b64(value)

    def decode(self, raw: Any, name: str) -> bytes:
        return unb64(raw, name, self.length)


class DistinctIds(WireValue):
    """A list of distinct non-empty ids (at most MAX_LIST_ITEMS), held as a tuple."""

    def encode(self, value: tuple[str, ...]) -> list[str]:
        return list(value)

    def decode(self, raw: Any, name: str) -> tuple[str, ...]:
        return str_list(raw, name)


@dataclass(frozen=True)
class BoundedText(WireValue):
    max_chars: int

    def encode(self, value: str) -> str:
        return value

    def decode(self, raw: Any, name: str) -> str:
        if not isinstance(raw, str) or len(raw) > self.max_chars:
            raise MalformedMessage(f"{name} must be a string of at most {self.max_chars} characters")
        return raw


@dataclass(frozen=True)
class WireArray:
    """How one array field travels: its dtype (or the dtypes it may take, of which the message's
    receiver checks the one its round expects) and rank, and optionally the length of its rows
    (shape[1:] == (row_bytes,)) and the header list its rows belong to (shape[0] == len(list))."""

    dtype: str | tuple[str, ...]
    rank: int
    row_bytes: int | None = None
    rows_per: str | None = None

    @property
    def dtypes(self) -> tuple[np.dtype, ...]:
        return tuple(map(np.dtype, (self.dtype,) if isinstance(self.dtype, str) else self.dtype))

    def read(self, name: str, payload: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
             parsed: Mapping[str, Any]) -> np.ndarray:
        """The array (dtype and rank checked by from_wire) once its shape rules hold."""
        array = arrays[name]
        if self.row_bytes is not None and array.shape[1:] != (self.row_bytes,):
            raise MalformedMessage(f"{name} must have {self.row_bytes}-byte rows")
        if self.rows_per is not None and array.shape[0] != len(parsed[self.rows_per]):
            raise MalformedMessage(f"{name}: {array.shape[0]} rows for {len(parsed[self.rows_per])} ids")
        return array


_WIRE = "wire"   # dataclass field metadata key holding a field's WireValue / WireArray


def wire_value(codec: WireValue) -> Any:
    return dataclasses.field(metadata={_WIRE: codec})


def wire_array(dtype: str | tuple[str, ...], rank: int, *, row_bytes: int | None = None, rows_per: str | None = None) -> Any:
    return dataclasses.field(metadata={_WIRE: WireArray(dtype, rank, row_bytes, rows_per)})


def wire_message(cls: type[T]) -> type[T]:
    """Make `cls` a frozen keyword-only dataclass and collect its wire declarations."""
    cls = dataclass(frozen=True, kw_only=True, eq=False)(cls)
    declared = {f.name: f.metadata[_WIRE] for f in dataclasses.fields(cls) if _WIRE in f.metadata}
    for name, spec in declared.items():
        if isinstance(spec, WireArray) and spec.rows_per is not None:
            # parse_payload reads fields in declaration order: the id list must come first
            assert isinstance(declared.get(spec.rows_per), DistinctIds) and \
                list(declared).index(spec.rows_per) < list(declared).index(name), (cls.__name__, name)
    cls.WIRE_FIELDS = declared
    cls.PAYLOAD = {name: spec for name, spec in declared.items() if isinstance(spec, WireValue)}
    cls.ARRAYS = {name: spec for name, spec in declared.items() if isinstance(spec, WireArray)}
    return cls
