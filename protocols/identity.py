"""Long-term Ed25519 device identities and the aggregator's registry of enrolled keys.

Every device (and the aggregator itself) owns one Ed25519 key pair for its whole life. The
private half never leaves the device; the public half is enrolled with the aggregator, which
then accepts a signed message from a device only if the signature verifies under the key
enrolled for the claimed device id. Secure aggregation binds its ephemeral X25519 keys and every
round message to these identities (see protocols/secagg).

Only raw 32-byte keys and PKCS#8/SubjectPublicKeyInfo PEM are supported as serialisations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping

from cryptography.exceptions import InvalidSignature as _CryptoInvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
PRIVATE_KEY_BYTES = 32
SIGNATURE_BYTES = 64


class InvalidSignature(Exception):
    """A signature is missing, malformed, or does not verify under the expected public key."""


class UnknownDevice(LookupError):
    """A device id has no enrolled public key."""


def _check_device_id(device_id: str) -> str:
    if not isinstance(device_id, str) or not device_id or len(device_id) > 256:
        raise ValueError(f"device id must be a non-empty string of at most 256 chars, got {device_id!r}")
    return device_id


# Encodings (sign bit ignored) of the Ed25519 points of small order, canonical or not: 0, 1, p-1, p,
# p+1 and the two order-8 points' y. A signature that verifies under such a key proves nothing
# (the all-zero key has a fixed forgery for every message), so such keys are never enrolled.
# The same list as libsodium's crypto_sign_ed25519 blocklist.
_SMALL_ORDER = tuple(bytes.fromhex(h) for h in (
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0100000000000000000000000000000000000000000000000000000000000000",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a"))


def is_weak_public_key(public_key: bytes) -> bool:
    """Whether a 32-byte Ed25519 key encodes a point of small order (whatever its sign bit)."""
    masked = bytes(public_key[:31]) + bytes([public_key[31] & 0x7F])
    return masked in _SMALL_ORDER


_P = 2 ** 255 - 19
_D = -121665 * pow(121666, -1, _P) % _P          # the curve's d


def check_curve_point(public_key: bytes) -> None:
    """ValueError unless a 32-byte Ed25519 key decodes to a curve point (RFC 8032 5.1.3: y below p,
    and (y^2 - 1) / (d y^2 + 1) a square, x = 0 with its sign bit clear). OpenSSL loads any 32
    bytes and only fails every verification under such a key, so a key mistyped by one hex digit
    (half of them are no point) was enrolled and each message of its device refused as badly
    signed. Checked where a key is enrolled, not on each verification (two modular powers)."""
    y = int.from_bytes(bytes(public_key), "little") & ((1 << 255) - 1)
    x_sign = public_key[31] >> 7
    if y >= _P:
        raise ValueError("not an Ed25519 public key: its y is not below the field's prime (not canonical)")
    x2 = (y * y - 1) * pow(_D * y * y + 1, -1, _P) % _P
    if (x2 == 0 and x_sign) or (x2 != 0 and pow(x2, (_P - 1) // 2, _P) != 1):
        raise ValueError("not an Ed25519 public key: no point of the curve (a mistyped key?)")


def _load_public_key(public_key: bytes) -> Ed25519PublicKey:
    if not isinstance(public_key, (bytes, bytearray)) or len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} raw bytes")
    if is_weak_public_key(public_key):
        raise ValueError("weak Ed25519 public key (a point of small order): refused")
    try:
        return Ed25519PublicKey.from_public_bytes(bytes(public_key))
    except ValueError as exc:
        raise ValueError(f"not an Ed25519 public key: {exc}") from None


def verify_signature(public_key: bytes, data: bytes, signature: bytes) -> None:
    """Raise InvalidSignature unless `signature` is a valid Ed25519 signature of `data`."""
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_BYTES:
        raise InvalidSignature(f"signature must be {SIGNATURE_BYTES} bytes, got "
                               f"{len(signature) if isinstance(signature, (bytes, bytearray)) else type(signature).__name__}")
    try:
        _load_public_key(public_key).verify(bytes(signature), bytes(data))
    except _CryptoInvalidSignature:
        raise InvalidSignature("Ed25519 signature does not verify") from None


@dataclass(frozen=True)
class DeviceIdentity:
    """A device id together with its Ed25519 private key."""

    device_id: str
    private_key: Ed25519PrivateKey = field(repr=False)

    def __post_init__(self) -> None:
        _check_device_id(self.device_id)

    @classmethod
    def generate(cls, device_id: str) -> "DeviceIdentity":
        return cls(device_id, Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, device_id: str, raw: bytes) -> "DeviceIdentity":
        if len(raw) != PRIVATE_KEY_BYTES:
            raise ValueError(f"an Ed25519 private key is {PRIVATE_KEY_BYTES} raw bytes")
        return cls(device_id, Ed25519PrivateKey.from_private_bytes(bytes(raw)))

    @classmethod
    def from_pem(cls, device_id: str, pem: bytes, password: bytes | None = None) -> "DeviceIdentity":
        key = serialization.load_pem_private_key(pem, password=password)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError("PEM does not hold an Ed25519 private key")
        return cls(device_id, key)

    def private_bytes(self) -> bytes:
        return self.private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                              serialization.NoEncryption())

    def to_pem(self, password: bytes | None = None) -> bytes:
        encryption = (serialization.BestAvailableEncryption(password) if password
                      else serialization.NoEncryption())
        return self.private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              encryption)

    @property
    def public_key_bytes(self) -> bytes:
        return self.private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                          serialization.PublicFormat.Raw)

    def public_key_pem(self) -> bytes:
        return self.private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(bytes(data))


def public_key_from_pem(pem: bytes) -> bytes:
    """Raw 32-byte form of an Ed25519 public key given as SubjectPublicKeyInfo PEM."""
    key = serialization.load_pem_public_key(pem)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("PEM does not hold an Ed25519 public key")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class IdentityRegistry:
    """The aggregator's table device id -> enrolled Ed25519 public key."""

    def __init__(self, enrolled: Mapping[str, bytes] | None = None) -> None:
        self._keys: dict[str, bytes] = {}
        for device_id, public_key in (enrolled or {}).items():
            self.enroll(device_id, public_key)

    def enroll(self, device_id: str, public_key: bytes) -> None:
        _check_device_id(device_id)
        _load_public_key(public_key)  # rejects malformed keys at enrolment, not at first use
        existing = self._keys.get(device_id)
        if existing is not None and existing != bytes(public_key):
            raise ValueError(f"device {device_id!r} is already enrolled with a different key; revoke it first")
        self._keys[device_id] = bytes(public_key)

    def revoke(self, device_id: str) -> None:
        self._keys.pop(device_id, None)

    def public_key(self, device_id: str) -> bytes:
        try:
            return self._keys[device_id]
        except KeyError:
            raise UnknownDevice(f"device {device_id!r} is not enrolled") from None

    def verify(self, device_id: str, data: bytes, signature: bytes) -> None:
        """Raise UnknownDevice or InvalidSignature unless `device_id` signed `data`."""
        verify_signature(self.public_key(device_id), data, signature)

    def __contains__(self, device_id: object) -> bool:
        return device_id in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def to_dict(self) -> dict[str, str]:
        """JSON-able form: device id -> hex public key."""
        return {device_id: key.hex() for device_id, key in self._keys.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, str]) -> "IdentityRegistry":
        return cls({device_id: bytes.fromhex(hex_key) for device_id, hex_key in data.items()})


def sender_verifier(sender: str, public_key: bytes):
    """An envelope verifier accepting only messages signed by ``sender`` with ``public_key``: what
    a device uses for the aggregator's messages (tasks, acks, aborts, status, artifacts), so an
    injected message is refused even when the broker would deliver it."""
    _load_public_key(public_key)

    def verify(claimed: str, signed: bytes, signature: bytes) -> None:
        from .envelope import EnvelopeError

        if claimed != sender:
            raise EnvelopeError(f"message from {claimed!r}; only {sender!r} may write here")
        try:
            verify_signature(public_key, signed, signature)
        except InvalidSignature as exc:
            raise EnvelopeError(f"signature rejected for {claimed!r}: {exc}") from None
    return verify
