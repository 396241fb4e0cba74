"""Ed25519 device identities: RFC 8032 vector, serialisation round trips, registry, clear errors."""

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocols.identity import (DeviceIdentity, IdentityRegistry, InvalidSignature, UnknownDevice,
                                public_key_from_pem, verify_signature)

# RFC 8032, section 7.1, TEST 1 (empty message) and TEST 2's key pair
RFC_SECRET_1 = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC_PUBLIC_1 = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
RFC_SIGNATURE_1 = bytes.fromhex("e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bac"
                                "c61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b")
RFC_SECRET_2 = bytes.fromhex("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb")
RFC_PUBLIC_2 = bytes.fromhex("3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c")


def test_rfc8032_vector_signs_and_verifies():
    identity = DeviceIdentity.from_private_bytes("rfc", RFC_SECRET_1)
    assert identity.public_key_bytes == RFC_PUBLIC_1
    assert identity.sign(b"") == RFC_SIGNATURE_1  # Ed25519 is deterministic
    verify_signature(RFC_PUBLIC_1, b"", RFC_SIGNATURE_1)
    with pytest.raises(InvalidSignature):
        verify_signature(RFC_PUBLIC_1, b"x", RFC_SIGNATURE_1)


def test_rfc8032_second_vector_public_key():
    assert DeviceIdentity.from_private_bytes("rfc2", RFC_SECRET_2).public_key_bytes == RFC_PUBLIC_2


def test_signature_verifies_with_plain_cryptography_api():
    identity = DeviceIdentity.generate("cam-01")
    data = b"fedfleet round 7"
    Ed25519PublicKey.from_public_bytes(identity.public_key_bytes).verify(identity.sign(data), data)


@pytest.mark.parametrize("tamper", ["data", "signature", "key", "short"])
def test_bad_signatures_raise_invalid_signature(tamper):
    identity, other = DeviceIdentity.generate("a"), DeviceIdentity.generate("b")
    data = b"payload"
    signature = identity.sign(data)
    key = identity.public_key_bytes
    if tamper == "data":
        data = b"payloae"
    elif tamper == "signature":
        signature = bytes([signature[0] ^ 1]) + signature[1:]
    elif tamper == "key":
        key = other.public_key_bytes
    else:
        signature = signature[:10]
    with pytest.raises(InvalidSignature):
        verify_signature(key, data, signature)


def test_raw_and_pem_round_trips_keep_the_key():
    identity = DeviceIdentity.generate("cam-02")
    raw = DeviceIdentity.from_private_bytes("cam-02", identity.private_bytes())
    pem = DeviceIdentity.from_pem("cam-02", identity.to_pem())
    locked = DeviceIdentity.from_pem("cam-02", identity.to_pem(b"pw"), password=b"pw")
    for copy in (raw, pem, locked):
        assert copy.public_key_bytes == identity.public_key_bytes
        verify_signature(identity.public_key_bytes, b"m", copy.sign(b"m"))
    assert public_key_from_pem(identity.public_key_pem()) == identity.public_key_bytes
    with pytest.raises(TypeError):
        DeviceIdentity.from_pem("cam-02", identity.to_pem(b"pw"))  # password needed


def test_invalid_identity_inputs():
    with pytest.raises(ValueError):
        DeviceIdentity.generate("")
    with pytest.raises(ValueError):
        DeviceIdentity.from_private_bytes("x", b"short")


def test_registry_enrol_verify_revoke():
    a, b = DeviceIdentity.generate("a"), DeviceIdentity.generate("b")
    registry = IdentityRegistry({"a": a.public_key_bytes})
    registry.enroll("b", b.public_key_bytes)
    registry.enroll("b", b.public_key_bytes)  # idempotent
    registry.verify("a", b"m", a.sign(b"m"))
    with pytest.raises(InvalidSignature):
        registry.verify("a", b"m", b.sign(b"m"))
    with pytest.raises(ValueError):
        registry.enroll("a", b.public_key_bytes)  # silent key replacement is refused
    with pytest.raises(ValueError):
        registry.enroll("c", b"\x00" * 5)
    assert set(registry) == {"a", "b"} and len(registry) == 2
    assert IdentityRegistry.from_dict(registry.to_dict()).public_key("b") == b.public_key_bytes
    registry.revoke("a")
    with pytest.raises(UnknownDevice):
        registry.verify("a", b"m", a.sign(b"m"))
