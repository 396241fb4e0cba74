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


# y = 2 and y = 7 have no x on the curve (x^2 = (y^2-1)/(d y^2+1) is no square mod p); the last is
# an ordinary key with one hex digit mistyped, and p + 2 is y = 2 written past the field (RFC 8032
# 5.1.3 refuses y >= p). OpenSSL loads any 32 bytes and only fails each verification, so such a key
# was enrolled (201) and every message of its device was refused as a bad signature.
NOT_A_POINT = ["02" + "00" * 31, "07" + "00" * 31, "ef" + "ff" * 30 + "7f",
               "075a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"]


def test_a_mistyped_key_in_the_list_is_no_curve_point():
    """The independent check: a key's y on the curve has an x (Euler's criterion on x^2, computed
    here in full); the typo case is the RFC 8032 test key 1 with its first digit changed."""
    p = 2 ** 255 - 19
    d = -121665 * pow(121666, -1, p) % p
    rfc_key_1 = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
    assert NOT_A_POINT[3][1:] == rfc_key_1[1:]
    for key_hex in NOT_A_POINT:
        y = int.from_bytes(bytes.fromhex(key_hex), "little") & ((1 << 255) - 1)
        x2 = (y * y - 1) * pow(d * y * y + 1, -1, p) % p
        assert y >= p or (x2 != 0 and pow(x2, (p - 1) // 2, p) != 1), key_hex


@pytest.mark.parametrize("key_hex", NOT_A_POINT)
def test_a_key_that_is_no_curve_point_is_refused_at_enrolment(key_hex, tmp_path):
    key = bytes.fromhex(key_hex)
    enrollment = Enrollment(Store(tmp_path / "state.db"))
    with pytest.raises(ValueError, match="not an Ed25519 public key"):
        enrollment.enroll("dev01", key)
    assert enrollment.store.device("dev01") is None        # nothing stored


def test_generated_keys_are_curve_points_and_enrolled(tmp_path):
    enrollment = Enrollment(Store(tmp_path / "state.db"))
    for i in range(64):
        key = DeviceIdentity.generate(f"dev{i:02d}").public_key_bytes
        assert enrollment.enroll(f"dev{i:02d}", key).public_key == key.hex()
