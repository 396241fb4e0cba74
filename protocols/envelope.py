"""The fedfleet envelope: one self-describing binary message on the wire.

Theory of operation
-------------------
Every MQTT payload exchanged between a device and the aggregator is one envelope::

    offset  size  field
    0       4     magic  b"FFE1"   (fedfleet envelope, major version 1)
    4       4     header_len       uint32 little-endian
    8       H     header           UTF-8 JSON object, validated by schema/envelope.schema.json
    8+H     P     payload          the tensor blobs, concatenated, each raw little-endian C-order

The header names the message (``type``), carries a random 128-bit ``id`` used for idempotency
(a receiver that has already applied an id acknowledges it again and applies nothing), the
``sender``, the protocol version and a type-specific ``body``. ``tensors`` lists each blob as
``{name, dtype, shape, offset, nbytes}``; blobs must tile the payload exactly, in order, with no
gaps and no overlap, so a decoder can reject a truncated or padded message before touching it.
``payload_sha256`` lets a receiver detect corruption end to end (MQTT only protects hops).

Headers are serialised canonically (sorted keys, no whitespace) so the same message always
encodes to the same bytes; the golden vectors in ``golden/`` pin that down for other languages.
An optional Ed25519 signature (``sig``, hex) covers ``canonical(header without sig)``; because the
header includes ``payload_sha256`` the signature binds the tensors too. A receiver verifies it over
the header bytes *as received* with the ``"sig"`` member cut out (:func:`signed_header_bytes`),
never over its own re-encoding: two codecs that wrote one float differently (Java once wrote
2^-24 with 17 digits, Python with 16) would otherwise refuse each other's signatures. Signing is injected as a
callable so this module needs no key material and stays free of I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
import math
import os
import struct
import time
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Callable

import numpy as np

MAGIC = b"FFE1"
PROTOCOL_VERSION = 1
PREFIX_LEN = 8  # magic + header_len

# Limits: a receiver refuses anything larger before parsing it.
MAX_HEADER_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 512 * 1024 * 1024  # reassembled size; single MQTT payloads are chunked far below
MAX_TENSORS = 64
MAX_NDIM = 8

# dtype names on the wire -> numpy little-endian dtypes. Names, not numpy codes, so that a
# non-Python client can implement the table from the schema alone.
WIRE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint32": np.dtype("<u4"),
    "uint64": np.dtype("<u8"),
}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}

Signer = Callable[[bytes], bytes]
Verifier = Callable[[str, bytes, bytes], None]  # (sender, signed_bytes, signature) -> raises


class EnvelopeError(ValueError):
    """A message that does not follow the wire contract. Nothing from it may be applied."""


class SenderNotAdmitted(EnvelopeError):
    """A message of a sender this receiver takes nothing from (yet): one whose chunks it holds none
    of, or whose key it has not been given. Said apart from other refusals: a receiver told of
    admissions on another channel than the messages (a shard: its pipe) may not have heard yet."""


@dataclass
class Envelope:
    """A decoded (or to-be-encoded) message: JSON-able fields plus named numpy tensors."""

    type: str
    sender: str
    body: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    id: str = field(default_factory=lambda: os.urandom(16).hex())
    ts: float = field(default_factory=time.time)
    v: int = PROTOCOL_VERSION
    sig: str | None = None
    # set by decode() alone, once it has hashed a payload held in immutable ``bytes``: (those bytes,
    # their SHA-256 hex), so that a layer above can reuse the hash for the very same memory.
    # encode() never reads it.
    verified_payload: tuple[memoryview, str] | None = field(default=None, repr=False, compare=False)

    def header_fields(self) -> dict[str, Any]:
        return {"v": self.v, "type": self.type, "id": self.id, "sender": self.sender,
                "ts": self.ts, "body": self.body}


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, compact separators, UTF-8, no NaN."""
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode("utf-8")
    except ValueError as exc:  # NaN/Inf in a JSON field
        raise EnvelopeError(f"header is not valid JSON: {exc}") from exc


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice."""


def object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` that refuses a repeated key (``DuplicateKeyError``)
    instead of keeping its last value."""
    # A duplicate key would let two receivers (one keeping the first value, one the last) read
    # one signed header differently.
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise DuplicateKeyError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


MAX_JSON_DEPTH = 32            # headers nest 4 deep; a hostile one must not reach the recursive parser
# a whole string, a bracket, or a quote that opens no whole string (only the last can fail to match)
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]|"')


def check_json_depth(text: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than ``limit`` before any recursive parser sees it (a 64 KiB
    header can hold 30,000 levels: RecursionError, not a refusal). Linear, no recursion: the
    tokens are read left to right, and a string that never closes ends the check at once. (Stripping
    strings with a regex first cost quadratic time on one: each of a header's 32,000 escaped quotes
    began a scan to its end, 12 s of the service's thread for one 64 KiB message from anyone.)"""
    depth = 0
    for token in _JSON_TOKEN.finditer(text):
        first = token.group()[0]
        if first == '"':
            if token.end() - token.start() == 1:
                raise ValueError("JSON string never closes")
            continue
        depth += 1 if first in "[{" else -1
        if depth > limit:
            raise ValueError(f"JSON nested deeper than {limit} levels")


INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1       # what a JSON integer on the wire may hold (int64 ∪ uint64)
MAX_SHAPE_BYTES = (1 << 63) - 1                    # a tensor's non-zero dimensions times its item size, at most


def _finite_float(token: str) -> float:
    """A JSON float as binary64; one that overflows it (``1e400``) is refused, not made Infinity."""
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"the number {token[:40]} overflows a binary64 float")
    return value


def _int_in_range(token: str) -> int:
    """A JSON integer within −2^63 … 2^64 − 1 (docs/protocol.md); others are refused."""
    value = int(token)
    if not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"the integer {token[:40]}… is outside -2^63 … 2^64 - 1")
    return value


def parse_strict_json(data: bytes) -> Any:
    """RFC 8259 JSON from UTF-8 bytes, refusing what Python's json module lets through: NaN and
    Infinity tokens, duplicate keys and lone surrogates, and nesting deeper than
    ``MAX_JSON_DEPTH``. Raises ValueError."""
    text = data.decode("utf-8")
    check_json_depth(text)
    value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=object_without_duplicates,
                       parse_float=_finite_float, parse_int=_int_in_range)
    # A lone surrogate can only come from a \ud800-\udfff escape: re-encode (UnicodeEncodeError, a
    # ValueError, for an unpaired one) only the rare header that has one, not every message.
    if _SURROGATE_ESCAPE.search(text):
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    return value


def _check_integer_fields(header: dict) -> None:
    """JSON Schema counts 1.0 as an integer; the wire contract does not (docs/protocol.md)."""
    def is_int(value):
        return type(value) is int

    if not is_int(header["v"]):
        raise EnvelopeError(f"header invalid at v: {header['v']!r} is not a JSON integer")
    for index, desc in enumerate(header["tensors"]):
        for key in ("offset", "nbytes"):
            if not is_int(desc[key]):
                raise EnvelopeError(f"header invalid at tensors/{index}/{key}: {desc[key]!r} is not a JSON integer")
        if not all(is_int(d) for d in desc["shape"]):
            raise EnvelopeError(f"header invalid at tensors/{index}/shape: {desc['shape']!r} holds a non-integer")


@lru_cache(maxsize=1)
def envelope_schema() -> dict:
    text = resources.files("protocols").joinpath("schema/envelope.schema.json").read_text()
    return json.loads(text)


@lru_cache(maxsize=1)
def _validator():
    """The reference validator (python-jsonschema): it words the error of an invalid header."""
    import jsonschema

    schema = envelope_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@lru_cache(maxsize=1)
def _fast_is_valid():
    """``header -> bool`` by jsonschema-rs (compiled; ``bench/ingest_steps.py`` measures it ~90x
    faster on a chunked 6.6 MB upload's 26 headers, which the reference validator took longer to
    check than the broker took to move them); the reference validator where it is not installed."""
    try:
        import jsonschema_rs
    except ImportError:
        return _validator().is_valid
    return jsonschema_rs.validator_for(envelope_schema()).is_valid


def encode(msg: Envelope, signer: Signer | None = None) -> bytes:
    """Serialise ``msg``. Tensors are converted to their wire dtype (little-endian, C order)."""
    if len(msg.tensors) > MAX_TENSORS:
        raise EnvelopeError(f"too many tensors: {len(msg.tensors)} > {MAX_TENSORS}")
    # Each tensor's wire bytes are a view where the array already has its wire layout (a copy
    # otherwise), hashed in place and copied once, into the message: a 6.7 MB masked upload and
    # each of its chunks were copied twice before (tobytes, then the join).
    descs, blobs, offset = [], [], 0
    payload_hash = hashlib.sha256()
    for name, arr in msg.tensors.items():
        arr = np.asarray(arr)
        wire = WIRE_DTYPES.get(_wire_name(arr.dtype))
        blob = memoryview(np.ascontiguousarray(arr, dtype=wire).reshape(-1).view(np.uint8))
        descs.append({"name": name, "dtype": _wire_name(arr.dtype), "shape": list(arr.shape),
                      "offset": offset, "nbytes": len(blob)})
        payload_hash.update(blob)
        blobs.append(blob)
        offset += len(blob)
    header = msg.header_fields()
    header["tensors"] = descs
    header["payload_sha256"] = payload_hash.hexdigest()
    if signer is not None:
        header["sig"] = signer(canonical_json(header)).hex()
    elif msg.sig is not None:
        header["sig"] = msg.sig
    hbytes = canonical_json(header)
    if len(hbytes) > MAX_HEADER_BYTES:
        raise EnvelopeError(f"header too large: {len(hbytes)} > {MAX_HEADER_BYTES} bytes")
    total = PREFIX_LEN + len(hbytes) + offset
    if total > MAX_MESSAGE_BYTES:
        raise EnvelopeError(f"message too large: {total} > {MAX_MESSAGE_BYTES} bytes")
    return b"".join([MAGIC, struct.pack("<I", len(hbytes)), hbytes, *blobs])


def decode(data: bytes, verifier: Verifier | None = None, *,
           max_bytes: int = MAX_MESSAGE_BYTES, hash_payload: bool | Callable[[str], bool] = True) -> Envelope:
    """Parse and validate ``data``; raise :class:`EnvelopeError` on any deviation.

    With a ``verifier`` the signature is mandatory and checked against the sender's key.
    Tensors are returned as read-only views on ``data`` (no copy). ``hash_payload`` (or, called
    with the message's type, its answer) False skips only the payload's sha256, for a chunk: its
    bytes end up inside a whole message that is decoded with every check
    (``chunking.MessageAssembler``), so hashing each chunk on the way would hash them twice.
    """
    header = _checked_header(data, max_bytes)
    hlen = struct.unpack_from("<I", data, 4)[0]
    payload = memoryview(data)[PREFIX_LEN + hlen:]
    if callable(hash_payload):
        hash_payload = hash_payload(header["type"])
    if hash_payload and hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise EnvelopeError("payload sha256 mismatch (corrupted or truncated message)")
    sig = header.get("sig")
    if verifier is not None:
        if sig is None:
            raise EnvelopeError(f"unsigned message from {header['sender']!r}")
        signed = signed_header_bytes(bytes(data[PREFIX_LEN:PREFIX_LEN + hlen]), sig)
        verifier(header["sender"], signed, bytes.fromhex(sig))
    env = _envelope(header, _decode_tensors(header["tensors"], payload))
    if hash_payload and isinstance(payload.obj, bytes):
        # only memory no one can write vouches for its hash later: a read-only view over a
        # bytearray, a numpy array or shared memory can still change under it
        env.verified_payload = (payload, header["payload_sha256"])
    return env


def signed_header_bytes(header_bytes: bytes, sig: str) -> bytes:
    """What the signature ``sig`` of a received header covers: the header bytes exactly as received
    with the member ``"sig":"<sig>"`` and the comma joining it to a neighbour cut out. For a
    canonical header (what every sender writes) that is ``canonical(header without sig)``, the bytes
    the sender signed, whatever this side's float formatter would write. The member must occur
    exactly once, written as the canonical writer writes it (a nested ``sig`` key holding the
    same signature, or a spaced or escaped one, is refused): the cut is then the top-level member,
    and the bytes left parse to the header the receiver acts on, less its ``sig``."""
    member = b'"sig":"' + sig.encode("ascii") + b'"'
    at = header_bytes.find(member)
    if at < 0 or header_bytes.find(member, at + 1) >= 0:
        raise EnvelopeError('the header must hold its "sig" member exactly once, written canonically')
    end = at + len(member)
    if header_bytes[at - 1:at] == b",":
        at -= 1
    elif header_bytes[end:end + 1] == b",":
        end += 1
    return header_bytes[:at] + header_bytes[end:]


def decode_header(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Envelope:
    """The message's header alone (validated as :func:`decode` validates it), no tensors, the
    payload's sha256 and the signature *not* checked: enough to route a large message to where
    it is decoded in full (an aggregator's ingest worker), never enough to act on it."""
    return _envelope(_checked_header(data, max_bytes), {})


def decode_checked(data: bytes) -> Envelope:
    """Decode bytes that :func:`decode` has already accepted (with the verifier it needed), e.g. in
    an ingest worker: the header is parsed again and the tensors are views, but the payload is
    not hashed again and the signature not verified again."""
    header = _checked_header(data, len(data))
    payload = memoryview(data)[PREFIX_LEN + struct.unpack_from("<I", data, 4)[0]:]
    return _envelope(header, _decode_tensors(header["tensors"], payload))


def _envelope(header: dict, tensors: dict[str, np.ndarray]) -> Envelope:
    return Envelope(type=header["type"], sender=header["sender"], body=header["body"],
                    tensors=tensors, id=header["id"], ts=header["ts"], v=header["v"], sig=header.get("sig"))


def _checked_header(data: bytes, max_bytes: int) -> dict:
    """The validated header of ``data`` (magic, length, strict JSON, schema, integers, version)."""
    if len(data) > max_bytes:
        raise EnvelopeError(f"message too large: {len(data)} > {max_bytes} bytes")
    if len(data) < PREFIX_LEN or data[:4] != MAGIC:
        raise EnvelopeError("not a fedfleet envelope (bad magic or too short)")
    (hlen,) = struct.unpack_from("<I", data, 4)
    if hlen > MAX_HEADER_BYTES or PREFIX_LEN + hlen > len(data):
        raise EnvelopeError(f"header length {hlen} exceeds the message or the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = parse_strict_json(bytes(data[PREFIX_LEN:PREFIX_LEN + hlen]))    # data may be a memoryview
    except ValueError as exc:     # UnicodeError and JSONDecodeError are ValueErrors
        raise EnvelopeError(f"header is not strict UTF-8 JSON: {exc}") from exc
    if not _fast_is_valid()(header):
        # the rare path (a broken or hostile sender): the reference validator says where. Its
        # regular expressions are Python's, whose "$" also matches before a final newline; where
        # it finds nothing the stricter ECMA-262 ones of jsonschema-rs refused, the header is refused.
        errors = sorted(_validator().iter_errors(header), key=lambda e: list(e.path))
        if not errors:
            raise EnvelopeError("header invalid: a string field does not match its pattern")
        where = "/".join(str(p) for p in errors[0].path) or "<header>"
        raise EnvelopeError(f"header invalid at {where}: {errors[0].message}")
    _check_integer_fields(header)
    if header["v"] != PROTOCOL_VERSION:
        raise EnvelopeError(f"unsupported protocol version {header['v']} (this side speaks {PROTOCOL_VERSION})")
    return header


def _decode_tensors(descs: list[dict], payload: memoryview) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    expected_offset = 0
    for d in descs:
        name = d["name"]
        if name in out:
            raise EnvelopeError(f"duplicate tensor name {name!r}")
        dt = WIRE_DTYPES[d["dtype"]]
        shape = tuple(d["shape"])
        count = math.prod(shape)
        if d["offset"] != expected_offset:
            raise EnvelopeError(f"tensor {name!r} offset {d['offset']} != {expected_offset} (gap or overlap)")
        if d["nbytes"] != count * dt.itemsize:
            raise EnvelopeError(f"tensor {name!r}: nbytes {d['nbytes']} does not match shape {shape} x {dt}")
        end = expected_offset + d["nbytes"]
        if end > len(payload):
            raise EnvelopeError(f"tensor {name!r} runs past the payload end (truncated message)")
        # an empty tensor's other dimensions still count: numpy (and a Java long) holds no shape whose
        # non-zero dimensions times the item size reach 2^63, and reshape raised ValueError past it
        if math.prod(n for n in shape if n) * dt.itemsize > MAX_SHAPE_BYTES:
            raise EnvelopeError(f"tensor {name!r}: shape {list(shape)} of {d['dtype']} cannot be held "
                                "(its non-zero dimensions times the item size reach 2^63)")
        arr = np.frombuffer(payload[expected_offset:end], dtype=dt).reshape(shape)
        out[name] = arr
        expected_offset = end
    if expected_offset != len(payload):
        raise EnvelopeError(f"{len(payload) - expected_offset} trailing payload bytes not described by any tensor")
    return out


def _wire_name(dt: np.dtype) -> str:
    name = _DTYPE_NAMES.get(np.dtype(dt).newbyteorder("<")) or _DTYPE_NAMES.get(np.dtype(dt))
    if name is None:
        raise EnvelopeError(f"dtype {dt} has no wire encoding (allowed: {sorted(WIRE_DTYPES)})")
    return name


def require_finite(msg: Envelope, *names: str) -> None:
    """Reject NaN/Inf in the named float tensors (all float tensors when none are named)."""
    for name in names or tuple(msg.tensors):
        arr = msg.tensors[name]
        # min and max are NaN when an entry is, ±Inf when one is: two passes, no mask the size of the tensor
        if arr.dtype.kind == "f" and arr.size and not (np.isfinite(arr.min()) and np.isfinite(arr.max())):
            raise EnvelopeError(f"tensor {name!r} contains NaN or Inf")


def require_tensor(msg: Envelope, name: str, dtype: str, shape: tuple[int | None, ...]) -> np.ndarray:
    """Fetch tensor ``name`` and check its wire dtype and shape (None = any size on that axis)."""
    if name not in msg.tensors:
        raise EnvelopeError(f"{msg.type}: missing tensor {name!r}")
    arr = msg.tensors[name]
    if arr.dtype != WIRE_DTYPES[dtype]:
        raise EnvelopeError(f"{msg.type}: tensor {name!r} has dtype {_wire_name(arr.dtype)}, expected {dtype}")
    if len(arr.shape) != len(shape) or any(s is not None and s != a for s, a in zip(shape, arr.shape)):
        raise EnvelopeError(f"{msg.type}: tensor {name!r} has shape {arr.shape}, expected {shape}")
    return arr


def body_field(msg: Envelope, key: str, kinds: type | tuple[type, ...]) -> Any:
    """Fetch a required body field with a type check (bool is not accepted as int)."""
    if key not in msg.body:
        raise EnvelopeError(f"{msg.type}: missing body field {key!r}")
    val = msg.body[key]
    if isinstance(val, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise EnvelopeError(f"{msg.type}: body field {key!r} must be {kinds}, got bool")
    if not isinstance(val, kinds):
        raise EnvelopeError(f"{msg.type}: body field {key!r} must be {kinds}, got {type(val).__name__}")
    return val
