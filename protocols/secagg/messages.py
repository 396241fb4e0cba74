"""Wire messages of secure aggregation, their canonical encoding and their signatures.

Every message carries job_id, round_id, group_id, sender and recipient, plus an Ed25519
signature by the sender's identity key over the canonical bytes

    b"fedfleet/secagg/message/v1\\n" + JSON(sort_keys, compact, ASCII) of
        {"header": {type, common fields, payload fields},
         "arrays": {name: [dtype, shape, sha256 hex of the little-endian bytes]}}

so a signature covers the array contents through their SHA-256 and nothing on the wire is
unsigned. `to_wire()` gives (JSON-able header with "type" and base64 "signature", {name: numpy
array}), ready for the project's envelope (JSON header + raw little-endian tensor blobs);
`decode(header, arrays)` / `Cls.from_wire` rebuild a message, checking every field's type and
every array's dtype, rank and shape, and raise MalformedMessage otherwise.

Each message class only *declares* its fields: a header field names its codec (`wire_value(...)`:
base64 bytes of a fixed length, a list of distinct ids, ...), an array field its dtype, rank and
shape rules (`wire_array(...)`); the one generic `payload()` / `arrays()` / `parse_payload()` on
`Message` encode and check every field from those declarations (`PAYLOAD` and `ARRAYS`, built by
the `@wire_message` decorator from the dataclass fields, in declaration order; the codecs live in
wire_fields.py). Verifying the signature and
the context against the round is the state machines' job (they know the keys and the round).

Client -> server: AdvertiseKeys, EncryptedShares, MaskedInput (after a ShareAccusation), ConsistencySignature,
UnmaskShares.
Server -> client: RoundStart, KeyDirectory, ForwardedShares, ConsistencyCheckRequest, UnmaskRequest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Mapping, TypeVar

import numpy as np

from protocols.identity import DeviceIdentity, InvalidSignature, verify_signature

from .config import RoundConfig
from .errors import BadSignature, ConfigError, MalformedMessage
from .events import Phase
from .wire_fields import (Base64Bytes, BoundedText, DistinctIds, WireArray, WireValue, b64, nonempty_str, rows,
                          unb64, wire_array, wire_message, wire_value)

MESSAGE_DOMAIN = b"fedfleet/secagg/message/v1\n"
CONSISTENCY_DOMAIN = b"fedfleet/secagg/consistency/v1\n"
_COMMON_FIELDS = ("job_id", "round_id", "group_id", "sender", "recipient")

M = TypeVar("M", bound="Message")


def _canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def array_digest(array: np.ndarray, sha256_hex: str | None = None) -> list[Any]:
    """[dtype, shape, SHA-256 hex of the little-endian bytes]; ``sha256_hex``: that hash, already
    computed over exactly these bytes (``Message.with_verified_digest``)."""
    contiguous = np.ascontiguousarray(array)
    if sha256_hex is None:
        sha256_hex = hashlib.sha256(contiguous.reshape(-1).view(np.uint8)).hexdigest()
    return [contiguous.dtype.str, list(contiguous.shape), sha256_hex]


def _same_bytes(array: np.ndarray, hashed: np.ndarray) -> bool:
    """``array``'s bytes are exactly the memory ``hashed`` views (the same start and length, both
    C-contiguous), which cannot have changed since it was hashed (``hashed`` is read-only)."""
    return (array.flags.c_contiguous and hashed.flags.c_contiguous and not hashed.flags.writeable
            and array.nbytes == hashed.nbytes
            and array.__array_interface__["data"][0] == hashed.__array_interface__["data"][0])


def consistency_statement(job_id: str, round_id: int, group_id: str, survivors: np.ndarray) -> bytes:
    """What a client signs in the consistency check: 'the survivor set of this round is U3',
    U3 given as its bitmap over the signed config's member list."""
    return CONSISTENCY_DOMAIN + _canonical_json([job_id, round_id, group_id]) + b"\n" + survivors.tobytes()


@dataclass(frozen=True, kw_only=True, eq=False)
class Message:
    TYPE: ClassVar[str] = ""
    PHASE: ClassVar[Phase]
    FROM_CLIENT: ClassVar[bool]
    # the fields beyond the common ones as declared, in declaration order (see wire_message), and
    # split into the header's (PAYLOAD) and the arrays (ARRAYS)
    WIRE_FIELDS: ClassVar[dict[str, WireValue | WireArray]] = {}
    PAYLOAD: ClassVar[dict[str, WireValue]] = {}
    ARRAYS: ClassVar[dict[str, WireArray]] = {}

    job_id: str
    round_id: int
    group_id: str
    sender: str
    recipient: str
    signature: bytes = b""
    # SHA-256 hex of an array field's bytes where the transport already hashed exactly those bytes
    # (with_verified_digest): a receiver's signature check then hashes a 6.7 MB masked input once
    verified_digests: dict[str, str] = dataclasses.field(default_factory=dict, init=False, repr=False)

    # -- the declared fields -------------------------------------------------------------
    def payload(self) -> dict[str, Any]:
        """JSON-able fields beyond the common ones."""
        return {name: codec.encode(getattr(self, name)) for name, codec in self.PAYLOAD.items()}

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.ARRAYS}

    @classmethod
    def parse_payload(cls, payload: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """Constructor keyword arguments from the header fields and the arrays (of checked dtype
        and rank), checked field by field in declaration order; raise MalformedMessage."""
        parsed: dict[str, Any] = {}
        for name, spec in cls.WIRE_FIELDS.items():
            parsed[name] = spec.read(name, payload, arrays, parsed)
        return parsed

    # -- generic -------------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        common = {name: getattr(self, name) for name in _COMMON_FIELDS}
        return {"type": self.TYPE, **common, **self.payload()}

    def canonical_bytes(self) -> bytes:
        digests = {name: array_digest(array, self.verified_digests.get(name)) for name, array in self.arrays().items()}
        return MESSAGE_DOMAIN + _canonical_json({"header": self.header(), "arrays": digests})

    def with_verified_digest(self: M, name: str, hashed: np.ndarray, sha256_hex: str) -> M:
        """Record that ``sha256_hex`` is the SHA-256 of ``hashed``'s bytes, as the caller checked
        against those very bytes (the envelope's payload hash, for a message whose one array is
        the whole payload). Kept only where array field ``name`` is that memory, which cannot have
        changed since (``_same_bytes``); otherwise the signature check hashes the array itself."""
        array = self.arrays().get(name)
        if array is not None and _same_bytes(array, hashed):
            self.verified_digests[name] = sha256_hex
        return self

    def signed(self: M, identity: DeviceIdentity) -> M:
        if identity.device_id != self.sender:
            raise ValueError(f"identity {identity.device_id!r} cannot sign for sender {self.sender!r}")
        return dataclasses.replace(self, signature=identity.sign(self.canonical_bytes()))

    def verify(self, public_key: bytes) -> None:
        if not self.signature:
            raise BadSignature(f"{self.TYPE} from {self.sender!r} carries no signature")
        try:
            verify_signature(public_key, self.canonical_bytes(), self.signature)
        except InvalidSignature as exc:
            raise BadSignature(f"{self.TYPE} from {self.sender!r}: {exc}") from None

    def to_wire(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        header = self.header()
        header["signature"] = b64(self.signature)
        return header, {name: np.ascontiguousarray(a) for name, a in self.arrays().items()}

    @classmethod
    def from_wire(cls: type[M], header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> M:
        if not isinstance(header, Mapping):
            raise MalformedMessage("header must be a mapping")
        if header.get("type") != cls.TYPE:
            raise MalformedMessage(f"expected a {cls.TYPE} message, got {header.get('type')!r}")
        expected_keys = {"type", "signature", *_COMMON_FIELDS, *cls.PAYLOAD}
        if set(header) != expected_keys:
            missing, extra = expected_keys - set(header), set(header) - expected_keys
            raise MalformedMessage(f"{cls.TYPE} header: missing {sorted(missing)}, unexpected {sorted(extra)}")
        if set(arrays) != set(cls.ARRAYS):
            raise MalformedMessage(f"{cls.TYPE} arrays must be exactly {sorted(cls.ARRAYS)}, got {sorted(arrays)}")
        checked_arrays = {}
        for name, spec in cls.ARRAYS.items():
            array = arrays[name]
            if not isinstance(array, np.ndarray) or array.dtype not in spec.dtypes or array.ndim != spec.rank:
                raise MalformedMessage(f"{cls.TYPE} array {name!r} must be {' or '.join(map(str, spec.dtypes))} "
                                       f"of rank {spec.rank}")
            checked_arrays[name] = array
        round_id = header["round_id"]
        if not isinstance(round_id, int) or isinstance(round_id, bool) or round_id < 0:
            raise MalformedMessage("round_id must be a non-negative integer")
        signature = unb64(header["signature"], "signature")
        common = {name: nonempty_str(header[name], name) for name in ("job_id", "group_id", "sender", "recipient")}
        payload = {key: header[key] for key in cls.PAYLOAD}
        return cls(**common, round_id=round_id, signature=signature,
                   **cls.parse_payload(payload, checked_arrays))


class RoundConfigValue(WireValue):
    def encode(self, value: RoundConfig) -> dict[str, Any]:
        return value.to_dict()

    def decode(self, raw: Any, name: str) -> RoundConfig:
        try:
            return RoundConfig.from_dict(raw)
        except ConfigError as exc:
            raise MalformedMessage(f"round config rejected: {exc}") from None
        except TypeError as exc:
            raise MalformedMessage(f"round config malformed: {exc}") from None


@dataclass(frozen=True)
class AdvertisedKeys:
    """One neighbour's entry of the key directory: its enrolled identity key and what it
    advertised, with its own signature, so the recipient can check the keys came from it."""

    device_id: str
    identity_public_key: bytes
    cipher_public_key: bytes
    mask_public_key: bytes
    advertise_signature: bytes

    @cached_property
    def wire_row(self) -> list[str]:
        # one entry goes into k directories, each encoded twice (signature + wire): encode once
        return [self.device_id, b64(self.identity_public_key), b64(self.cipher_public_key),
                b64(self.mask_public_key), b64(self.advertise_signature)]


class NeighbourKeysValue(WireValue):
    """Advertised keys as rows [device id, identity key, cipher key, mask key, signature] (base64)."""

    def encode(self, value: tuple[AdvertisedKeys, ...]) -> list[list[str]]:
        return [k.wire_row for k in value]

    def decode(self, raw: Any, name: str) -> tuple[AdvertisedKeys, ...]:
        keys = tuple(AdvertisedKeys(nonempty_str(d, "neighbour"), unb64(i, "identity key", 32), unb64(c, "cipher key", 32),
                                    unb64(m, "mask key", 32), unb64(s, "advertise signature", 64))
                     for d, i, c, m, s in rows(raw, name, 5))
        if len({k.device_id for k in keys}) != len(keys):
            raise MalformedMessage(f"{name} has duplicates")
        return keys


# ---- server -> client ---------------------------------------------------------------------

@wire_message
class RoundStart(Message):
    TYPE: ClassVar[str] = "secagg.round_start"
    PHASE: ClassVar[Phase] = Phase.ADVERTISE_KEYS
    FROM_CLIENT: ClassVar[bool] = False
    config: RoundConfig = wire_value(RoundConfigValue())


@wire_message
class KeyDirectory(Message):
    """U1 as a member bitmap, the recipient's neighbours' advertised keys, and -- only when the
    consistency check is on -- the identity keys of all of U1 in member order (to verify the
    consistency signatures)."""

    TYPE: ClassVar[str] = "secagg.key_directory"
    PHASE: ClassVar[Phase] = Phase.SHARE_KEYS
    FROM_CLIENT: ClassVar[bool] = False
    participants: np.ndarray = wire_array("|u1", 1)
    identity_keys: np.ndarray = wire_array("|u1", 2, row_bytes=32)
    neighbour_keys: tuple[AdvertisedKeys, ...] = wire_value(NeighbourKeysValue())


@wire_message
class ForwardedShares(Message):
    TYPE: ClassVar[str] = "secagg.forwarded_shares"
    PHASE: ClassVar[Phase] = Phase.MASKED_INPUT
    FROM_CLIENT: ClassVar[bool] = False
    senders: tuple[str, ...] = wire_value(DistinctIds())
    ciphertexts: np.ndarray = wire_array("|u1", 2, rows_per="senders")


@wire_message
class ConsistencyCheckRequest(Message):
    TYPE: ClassVar[str] = "secagg.consistency_request"
    PHASE: ClassVar[Phase] = Phase.CONSISTENCY_CHECK
    FROM_CLIENT: ClassVar[bool] = False
    survivors: np.ndarray = wire_array("|u1", 1)  # U3 as a member bitmap


@wire_message
class UnmaskRequest(Message):
    """U3 and U2 - U3 as member bitmaps, plus (with the consistency check) the signatures of U3
    by U4: `consistency_signers` is U4's bitmap and row i of `consistency_signatures` belongs to
    the i-th signer in member order."""

    TYPE: ClassVar[str] = "secagg.unmask_request"
    PHASE: ClassVar[Phase] = Phase.UNMASK
    FROM_CLIENT: ClassVar[bool] = False
    survivors: np.ndarray = wire_array("|u1", 1)
    dropped: np.ndarray = wire_array("|u1", 1)
    consistency_signers: np.ndarray = wire_array("|u1", 1)
    consistency_signatures: np.ndarray = wire_array("|u1", 2, row_bytes=64)


@wire_message
class RoundAborted(Message):
    """The server gave the round up (fewer than t answers in a phase, failed reconstruction, or
    its caller's deadline): nothing from this round is or will be applied. Sent in any phase
    (PHASE is nominal); the client erases its secrets at once instead of waiting for its timer."""

    TYPE: ClassVar[str] = "secagg.round_aborted"
    PHASE: ClassVar[Phase] = Phase.ADVERTISE_KEYS
    FROM_CLIENT: ClassVar[bool] = False
    MAX_REASON: ClassVar[int] = 1000
    reason: str = wire_value(BoundedText(MAX_REASON))


# ---- client -> server ---------------------------------------------------------------------

@wire_message
class AdvertiseKeys(Message):
    TYPE: ClassVar[str] = "secagg.advertise_keys"
    PHASE: ClassVar[Phase] = Phase.ADVERTISE_KEYS
    FROM_CLIENT: ClassVar[bool] = True
    cipher_public_key: bytes = wire_value(Base64Bytes(32))
    mask_public_key: bytes = wire_value(Base64Bytes(32))


@wire_message
class EncryptedShares(Message):
    TYPE: ClassVar[str] = "secagg.encrypted_shares"
    PHASE: ClassVar[Phase] = Phase.SHARE_KEYS
    FROM_CLIENT: ClassVar[bool] = True
    recipients: tuple[str, ...] = wire_value(DistinctIds())
    ciphertexts: np.ndarray = wire_array("|u1", 2, rows_per="recipients")
    self_mask_commitment: bytes = wire_value(Base64Bytes(32))


@wire_message
class MaskedInput(Message):
    TYPE: ClassVar[str] = "secagg.masked_input"
    PHASE: ClassVar[Phase] = Phase.MASKED_INPUT
    FROM_CLIENT: ClassVar[bool] = True
    masked_input: np.ndarray = wire_array(("<u8", "<u4"), 1)       # the round's ring words (server checks which)


@wire_message
class ShareAccusation(Message):
    """Sent just before its masked input by a member some of whose forwarded share rows did not
    decrypt: their senders. The member goes on without those shares (it holds no share of their
    secrets to give at the unmasking, which the other holders cover); nothing secret is revealed,
    so the server cannot tell a bad row from a false accusation by one member. It counts them:
    a sender accused by a strict majority of the neighbours it sent rows to, and by at least three,
    is a culprit (``ServerSecAgg.culprits``), which no minority of lying members, nor a pair, can
    make an honest one."""

    TYPE: ClassVar[str] = "secagg.share_accusation"
    PHASE: ClassVar[Phase] = Phase.MASKED_INPUT
    FROM_CLIENT: ClassVar[bool] = True
    accused: tuple[str, ...] = wire_value(DistinctIds())


@wire_message
class ConsistencySignature(Message):
    TYPE: ClassVar[str] = "secagg.consistency_signature"
    PHASE: ClassVar[Phase] = Phase.CONSISTENCY_CHECK
    FROM_CLIENT: ClassVar[bool] = True
    survivors_signature: bytes = wire_value(Base64Bytes(64))


@wire_message
class UnmaskShares(Message):
    """Shares of self-mask seeds b_v for surviving v, of mask keys s_v^SK for dropped v."""

    TYPE: ClassVar[str] = "secagg.unmask_shares"
    PHASE: ClassVar[Phase] = Phase.UNMASK
    FROM_CLIENT: ClassVar[bool] = True
    self_mask_owners: tuple[str, ...] = wire_value(DistinctIds())
    key_owners: tuple[str, ...] = wire_value(DistinctIds())
    self_mask_shares: np.ndarray = wire_array("|u1", 2, rows_per="self_mask_owners")
    key_shares: np.ndarray = wire_array("|u1", 2, rows_per="key_owners")


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in (RoundStart, KeyDirectory, ForwardedShares, ConsistencyCheckRequest,
                              UnmaskRequest, RoundAborted, AdvertiseKeys, EncryptedShares, MaskedInput,
                              ShareAccusation, ConsistencySignature, UnmaskShares)}


def decode(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Message:
    """Rebuild any secagg message from its wire form (dispatch on header["type"])."""
    kind = header.get("type") if isinstance(header, Mapping) else None
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise MalformedMessage(f"unknown secagg message type {kind if isinstance(header, Mapping) else header!r}")
    return MESSAGE_TYPES[kind].from_wire(header, arrays)
