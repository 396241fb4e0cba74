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
every array's dtype and rank, and raise MalformedMessage otherwise. Verifying the signature and
the context against the round is the state machines' job (they know the keys and the round).

Client -> server: AdvertiseKeys, EncryptedShares, MaskedInput, ConsistencySignature, UnmaskShares.
Server -> client: RoundStart, KeyDirectory, ForwardedShares, ConsistencyCheckRequest, UnmaskRequest.
"""

from __future__ import annotations

import base64
import binascii
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

MESSAGE_DOMAIN = b"fedfleet/secagg/message/v1\n"
CONSISTENCY_DOMAIN = b"fedfleet/secagg/consistency/v1\n"
_COMMON_FIELDS = ("job_id", "round_id", "group_id", "sender", "recipient")
# Upper bound on list fields, so a hostile header cannot make us allocate without limit.
MAX_LIST_ITEMS = 1 << 20

M = TypeVar("M", bound="Message")


def _canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(value: Any, what: str, length: int | None = None) -> bytes:
    if not isinstance(value, str):
        raise MalformedMessage(f"{what} must be a base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedMessage(f"{what} is not valid base64") from None
    if length is not None and len(raw) != length:
        raise MalformedMessage(f"{what} must be {length} bytes, got {len(raw)}")
    return raw


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise MalformedMessage(f"{what} must be a non-empty string (<= 256 chars)")
    return value


def _str_list(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        raise MalformedMessage(f"{what} must be a list")
    items = tuple(_str(item, f"{what} item") for item in value)
    if len(set(items)) != len(items):
        raise MalformedMessage(f"{what} has duplicates")
    return items


def _rows(value: Any, what: str, width: int) -> list[list[Any]]:
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        raise MalformedMessage(f"{what} must be a list")
    for row in value:
        if not isinstance(row, list) or len(row) != width:
            raise MalformedMessage(f"each {what} entry must be a list of {width} items")
    return value


def array_digest(array: np.ndarray) -> list[Any]:
    contiguous = np.ascontiguousarray(array)
    return [contiguous.dtype.str, list(contiguous.shape), hashlib.sha256(contiguous.reshape(-1).view(np.uint8)).hexdigest()]


def consistency_statement(job_id: str, round_id: int, group_id: str, survivors: np.ndarray) -> bytes:
    """What a client signs in the consistency check: 'the survivor set of this round is U3',
    U3 given as its bitmap over the signed config's member list."""
    return CONSISTENCY_DOMAIN + _canonical_json([job_id, round_id, group_id]) + b"\n" + survivors.tobytes()


@dataclass(frozen=True, kw_only=True, eq=False)
class Message:
    TYPE: ClassVar[str] = ""
    PHASE: ClassVar[Phase]
    FROM_CLIENT: ClassVar[bool]
    # name -> (numpy dtype string, rank) of each array the message carries
    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {}

    job_id: str
    round_id: int
    group_id: str
    sender: str
    recipient: str
    signature: bytes = b""

    # -- per-type hooks ------------------------------------------------------------------
    def payload(self) -> dict[str, Any]:
        """JSON-able fields beyond the common ones."""
        return {}

    def arrays(self) -> dict[str, np.ndarray]:
        return {}

    @classmethod
    def parse_payload(cls, payload: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """Constructor keyword arguments from a checked payload; raise MalformedMessage."""
        return {}

    PAYLOAD_KEYS: ClassVar[tuple[str, ...]] = ()

    # -- generic -------------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        common = {name: getattr(self, name) for name in _COMMON_FIELDS}
        return {"type": self.TYPE, **common, **self.payload()}

    def canonical_bytes(self) -> bytes:
        digests = {name: array_digest(array) for name, array in self.arrays().items()}
        return MESSAGE_DOMAIN + _canonical_json({"header": self.header(), "arrays": digests})

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
        header["signature"] = _b64(self.signature)
        return header, {name: np.ascontiguousarray(a) for name, a in self.arrays().items()}

    @classmethod
    def from_wire(cls: type[M], header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> M:
        if not isinstance(header, Mapping):
            raise MalformedMessage("header must be a mapping")
        if header.get("type") != cls.TYPE:
            raise MalformedMessage(f"expected a {cls.TYPE} message, got {header.get('type')!r}")
        expected_keys = {"type", "signature", *_COMMON_FIELDS, *cls.PAYLOAD_KEYS}
        if set(header) != expected_keys:
            missing, extra = expected_keys - set(header), set(header) - expected_keys
            raise MalformedMessage(f"{cls.TYPE} header: missing {sorted(missing)}, unexpected {sorted(extra)}")
        if set(arrays) != set(cls.ARRAYS):
            raise MalformedMessage(f"{cls.TYPE} arrays must be exactly {sorted(cls.ARRAYS)}, got {sorted(arrays)}")
        checked_arrays = {}
        for name, (dtype, rank) in cls.ARRAYS.items():
            array = arrays[name]
            if not isinstance(array, np.ndarray) or array.dtype != np.dtype(dtype) or array.ndim != rank:
                raise MalformedMessage(f"{cls.TYPE} array {name!r} must be {dtype} of rank {rank}")
            checked_arrays[name] = array
        round_id = header["round_id"]
        if not isinstance(round_id, int) or isinstance(round_id, bool) or round_id < 0:
            raise MalformedMessage("round_id must be a non-negative integer")
        signature = _unb64(header["signature"], "signature")
        common = {name: _str(header[name], name) for name in ("job_id", "group_id", "sender", "recipient")}
        payload = {key: header[key] for key in cls.PAYLOAD_KEYS}
        return cls(**common, round_id=round_id, signature=signature,
                   **cls.parse_payload(payload, checked_arrays))


def _share_rows(array: np.ndarray, owners: tuple[str, ...], what: str) -> None:
    if array.shape[0] != len(owners):
        raise MalformedMessage(f"{what}: {array.shape[0]} rows for {len(owners)} ids")


# ---- server -> client ---------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, eq=False)
class RoundStart(Message):
    TYPE: ClassVar[str] = "secagg.round_start"
    PHASE: ClassVar[Phase] = Phase.ADVERTISE_KEYS
    FROM_CLIENT: ClassVar[bool] = False
    PAYLOAD_KEYS: ClassVar[tuple[str, ...]] = ("config",)
    config: RoundConfig

    def payload(self) -> dict[str, Any]:
        return {"config": self.config.to_dict()}

    @classmethod
    def parse_payload(cls, payload, arrays):
        try:
            return {"config": RoundConfig.from_dict(payload["config"])}
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
        return [self.device_id, _b64(self.identity_public_key), _b64(self.cipher_public_key),
                _b64(self.mask_public_key), _b64(self.advertise_signature)]


@dataclass(frozen=True, kw_only=True, eq=False)
class KeyDirectory(Message):
    """U1 as a member bitmap, the recipient's neighbours' advertised keys, and -- only when the
    consistency check is on -- the identity keys of all of U1 in member order (to verify the
    consistency signatures)."""

    TYPE: ClassVar[str] = "secagg.key_directory"
    PHASE: ClassVar[Phase] = Phase.SHARE_KEYS
    FROM_CLIENT: ClassVar[bool] = False
    PAYLOAD_KEYS: ClassVar[tuple[str, ...]] = ("neighbour_keys",)
    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {"participants": ("|u1", 1), "identity_keys": ("|u1", 2)}
    participants: np.ndarray
    identity_keys: np.ndarray
    neighbour_keys: tuple[AdvertisedKeys, ...]

    def payload(self) -> dict[str, Any]:
        return {"neighbour_keys": [k.wire_row for k in self.neighbour_keys]}

    def arrays(self):
        return {"participants": self.participants, "identity_keys": self.identity_keys}

    @classmethod
    def parse_payload(cls, payload, arrays):
        if arrays["identity_keys"].shape[1:] != (32,):
            raise MalformedMessage("identity_keys must have 32-byte rows")
        keys = tuple(AdvertisedKeys(_str(d, "neighbour"), _unb64(i, "identity key", 32), _unb64(c, "cipher key", 32),
                                    _unb64(m, "mask key", 32), _unb64(s, "advertise signature", 64))
                     for d, i, c, m, s in _rows(payload["neighbour_keys"], "neighbour_keys", 5))
        if len({k.device_id for k in keys}) != len(keys):
            raise MalformedMessage("neighbour_keys has duplicates")
        return {"participants": arrays["participants"], "identity_keys": arrays["identity_keys"],
                "neighbour_keys": keys}


@dataclass(frozen=True, kw_only=True, eq=False)
class ForwardedShares(Message):
    TYPE: ClassVar[str] = "secagg.forwarded_shares"
    PHASE: ClassVar[Phase] = Phase.MASKED_INPUT
    FROM_CLIENT: ClassVar[bool] = False
    PAYLOAD_KEYS: ClassVar[tuple[str, ...]] = ("senders",)
    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {"ciphertexts": ("|u1", 2)}
    senders: tuple[str, ...]
    ciphertexts: np.ndarray

    def payload(self):
        return {"senders": list(self.senders)}

    def arrays(self):
        return {"ciphertexts": self.ciphertexts}

    @classmethod
    def parse_payload(cls, payload, arrays):
        senders = _str_list(payload["senders"], "senders")
        _share_rows(arrays["ciphertexts"], senders, "ciphertexts")
        return {"senders": senders, "ciphertexts": arrays["ciphertexts"]}


@dataclass(frozen=True, kw_only=True, eq=False)
class ConsistencyCheckRequest(Message):
    TYPE: ClassVar[str] = "secagg.consistency_request"
    PHASE: ClassVar[Phase] = Phase.CONSISTENCY_CHECK
    FROM_CLIENT: ClassVar[bool] = False
    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {"survivors": ("|u1", 1)}
    survivors: np.ndarray  # U3 as a member bitmap

    def arrays(self):
        return {"survivors": self.survivors}

    @classmethod
    def parse_payload(cls, payload, arrays):
        return {"survivors": arrays["survivors"]}


@dataclass(frozen=True, kw_only=True, eq=False)
class UnmaskRequest(Message):
    """U3 and U2 - U3 as member bitmaps, plus (with the consistency check) the signatures of U3
    by U4: `consistency_signers` is U4's bitmap and row i of `consistency_signatures` belongs to
    the i-th signer in member order."""

    TYPE: ClassVar[str] = "secagg.unmask_request"
    PHASE: ClassVar[Phase] = Phase.UNMASK
    FROM_CLIENT: ClassVar[bool] = False
    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {
        "survivors": ("|u1", 1), "dropped": ("|u1", 1), "consistency_signers": ("|u1", 1),
        "consistency_signatures": ("|u1", 2)}
    survivors: np.ndarray
    dropped: np.ndarray
    consistency_signers: np.ndarray
    consistency_signatures: np.ndarray

    def arrays(self):
        return {"survivors": self.survivors, "dropped": self.dropped,
                "consistency_signers": self.consistency_signers, "consistency_signatures": self.consistency_signatures}

    @classmethod
    def parse_payload(cls, payload, arrays):
        if arrays["consistency_signatures"].shape[1:] != (64,):
            raise MalformedMessage("consistency_signatures must have 64-byte rows")
        return dict(arrays)


@dataclass(frozen=True, kw_only=True, eq=False)
class RoundAborted(Message):
    """The server gave the round up (fewer than t answers in a phase, failed reconstruction, or
    its caller's deadline): nothing from this round is or will be applied. Sent in any phase
    (PHASE is nominal); the client erases its secrets at once instead of waiting for its timer."""

    TYPE: ClassVar[str] = "secagg.round_aborted"
    PHASE: ClassVar[Phase] = Phase.ADVERTISE_KEYS
    FROM_CLIENT: ClassVar[bool] = False
    PAYLOAD_KEYS: ClassVar[tuple[str, ...]] = ("reason",)
    MAX_REASON = 1000
    reason: str

    def payload(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def parse_payload(cls, payload, arrays):
        reason = payload["reason"]
        if not isinstance(reason, str) or len(reason) > cls.MAX_REASON:
            raise MalformedMessage(f"reason must be a string of at most {cls.MAX_REASON} characters")
        return {"reason": reason}


# ---- client -> server ---------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, eq=False)
class AdvertiseKeys(Message):
    TYPE: ClassVar[str] = "secagg.advertise_keys"
    PHASE: ClassVar[Phase] = Phase.ADVERTISE_KEYS
    FROM_CLIENT: ClassVar[bool] = True
    PAYLOAD_KEYS: ClassVar[tuple[str, ...]] = ("cipher_public_key", "mask_public_key")
    cipher_public_key: bytes
    mask_public_key: bytes

    def payload(self):
        return {"cipher_public_key": _b64(self.cipher_public_key), "mask_public_key": _b64(self.mask_public_key)}

    @classmethod
    def parse_payload(cls, payload, arrays):
        return {"cipher_public_key": _unb64(payload["cipher_public_key"], "cipher_public_key", 32),
                "mask_public_key": _unb64(payload["mask_public_key"], "mask_public_key", 32)}


@dataclass(frozen=True, kw_only=True, eq=False)
class EncryptedShares(Message):
    TYPE: ClassVar[str] = "secagg.encrypted_shares"
    PHASE: ClassVar[Phase] = Phase.SHARE_KEYS
    FROM_CLIENT: ClassVar[bool] = True
    PAYLOAD_KEYS: ClassVar[tuple[str, ...]] = ("recipients", "self_mask_commitment")
    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {"ciphertexts": ("|u1", 2)}
    recipients: tuple[str, ...]
    ciphertexts: np.ndarray
    self_mask_commitment: bytes

    def payload(self):
        return {"recipients": list(self.recipients), "self_mask_commitment": _b64(self.self_mask_commitment)}

    def arrays(self):
        return {"ciphertexts": self.ciphertexts}

    @classmethod
    def parse_payload(cls, payload, arrays):
        recipients = _str_list(payload["recipients"], "recipients")
        _share_rows(arrays["ciphertexts"], recipients, "ciphertexts")
        return {"recipients": recipients, "ciphertexts": arrays["ciphertexts"],
                "self_mask_commitment": _unb64(payload["self_mask_commitment"], "self_mask_commitment", 32)}


@dataclass(frozen=True, kw_only=True, eq=False)
class MaskedInput(Message):
    TYPE: ClassVar[str] = "secagg.masked_input"
    PHASE: ClassVar[Phase] = Phase.MASKED_INPUT
    FROM_CLIENT: ClassVar[bool] = True
    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {"masked_input": ("<u8", 1)}
    masked_input: np.ndarray

    def arrays(self):
        return {"masked_input": self.masked_input}

    @classmethod
    def parse_payload(cls, payload, arrays):
        return {"masked_input": arrays["masked_input"]}


@dataclass(frozen=True, kw_only=True, eq=False)
class ConsistencySignature(Message):
    TYPE: ClassVar[str] = "secagg.consistency_signature"
    PHASE: ClassVar[Phase] = Phase.CONSISTENCY_CHECK
    FROM_CLIENT: ClassVar[bool] = True
    PAYLOAD_KEYS: ClassVar[tuple[str, ...]] = ("survivors_signature",)
    survivors_signature: bytes

    def payload(self):
        return {"survivors_signature": _b64(self.survivors_signature)}

    @classmethod
    def parse_payload(cls, payload, arrays):
        return {"survivors_signature": _unb64(payload["survivors_signature"], "survivors_signature", 64)}


@dataclass(frozen=True, kw_only=True, eq=False)
class UnmaskShares(Message):
    """Shares of self-mask seeds b_v for surviving v, of mask keys s_v^SK for dropped v."""

    TYPE: ClassVar[str] = "secagg.unmask_shares"
    PHASE: ClassVar[Phase] = Phase.UNMASK
    FROM_CLIENT: ClassVar[bool] = True
    PAYLOAD_KEYS: ClassVar[tuple[str, ...]] = ("self_mask_owners", "key_owners")
    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {"self_mask_shares": ("|u1", 2), "key_shares": ("|u1", 2)}
    self_mask_owners: tuple[str, ...]
    self_mask_shares: np.ndarray
    key_owners: tuple[str, ...]
    key_shares: np.ndarray

    def payload(self):
        return {"self_mask_owners": list(self.self_mask_owners), "key_owners": list(self.key_owners)}

    def arrays(self):
        return {"self_mask_shares": self.self_mask_shares, "key_shares": self.key_shares}

    @classmethod
    def parse_payload(cls, payload, arrays):
        self_owners = _str_list(payload["self_mask_owners"], "self_mask_owners")
        key_owners = _str_list(payload["key_owners"], "key_owners")
        _share_rows(arrays["self_mask_shares"], self_owners, "self_mask_shares")
        _share_rows(arrays["key_shares"], key_owners, "key_shares")
        return {"self_mask_owners": self_owners, "self_mask_shares": arrays["self_mask_shares"],
                "key_owners": key_owners, "key_shares": arrays["key_shares"]}


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in (RoundStart, KeyDirectory, ForwardedShares, ConsistencyCheckRequest,
                              UnmaskRequest, RoundAborted, AdvertiseKeys, EncryptedShares, MaskedInput,
                              ConsistencySignature, UnmaskShares)}


def decode(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Message:
    """Rebuild any secagg message from its wire form (dispatch on header["type"])."""
    kind = header.get("type") if isinstance(header, Mapping) else None
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise MalformedMessage(f"unknown secagg message type {kind if isinstance(header, Mapping) else header!r}")
    return MESSAGE_TYPES[kind].from_wire(header, arrays)
