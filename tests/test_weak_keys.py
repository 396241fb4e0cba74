"""Enrolment refuses invalid and weak Ed25519 keys: under the all-zero key a fixed forged signature
(R = the identity point, S = 0) verifies for about a quarter of all messages — checked here
against the crypto library itself — so such a key must never be enrolled."""

import pytest
from cryptography.exceptions import InvalidSignature as CryptoInvalid
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from aggregator.security.enrollment import Enrollment
from aggregator.storage.store import Store, StoreError
from protocols.identity import DeviceIdentity, IdentityRegistry, is_weak_public_key

FORGERY = bytes.fromhex("01" + "00" * 31) + bytes(32)
SMALL_ORDER = ["00" * 32, "01" + "00" * 31, "ec" + "ff" * 30 + "7f", "ed" + "ff" * 30 + "7f",
               "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
               "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",   # sign bit set
               "00" * 31 + "80"]


def forged_messages(key: bytes, tries: int = 64) -> int:
    ok = 0
    for i in range(tries):
        try:
            Ed25519PublicKey.from_public_bytes(key).verify(FORGERY, b"message %d" % i)
            ok += 1
        except CryptoInvalid:
            pass
    return ok


def test_the_all_zero_key_admits_a_fixed_forgery_in_the_crypto_library():
    assert forged_messages(bytes(32)) > 0                  # why the check below exists
    assert forged_messages(DeviceIdentity.generate("d").public_key_bytes) == 0


@pytest.mark.parametrize("key_hex", SMALL_ORDER)
def test_small_order_keys_are_refused_everywhere(key_hex, tmp_path):
    key = bytes.fromhex(key_hex)
    assert is_weak_public_key(key)
    with pytest.raises(ValueError, match="weak"):
        IdentityRegistry({"dev01": key})
    enrollment = Enrollment(Store(tmp_path / "state.db"))
    with pytest.raises((ValueError, StoreError)):
        enrollment.enroll("dev01", key)
    assert enrollment.store.device("dev01") is None        # nothing stored


@pytest.mark.parametrize("key", [b"", bytes(31), bytes(33), b"\x01" * 31 + b"\x02" * 2])
def test_wrong_length_keys_are_refused(key):
    with pytest.raises(ValueError):
        IdentityRegistry({"dev01": key})


def test_an_ordinary_key_is_enrolled(tmp_path):
    key = DeviceIdentity.generate("dev01").public_key_bytes
    assert not is_weak_public_key(key)
    creds = Enrollment(Store(tmp_path / "state.db")).enroll("dev01", key)
    assert creds.public_key == key.hex()
