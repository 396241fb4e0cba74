"""The wire protocol is language-neutral: an independent Java codec, written from docs/protocol.md,
the schema and the golden vectors only (the Java device library's, clients/java/src/org/fedfleet/wire,
driven by tests/conformance/java/Main.java), must decode every golden vector
to its index.json header, re-encode it byte-identically, reassemble the chunk vectors, reject
corrupted variants with clear errors, verify an Ed25519 signature made here, re-emit canonical JSON
written here byte-identically, and reproduce the SecAgg mask PRG.

The Python side of each cross-check uses numpy, json, hashlib and `cryptography` directly, never
the `protocols` codec, so a shared misunderstanding cannot make both sides agree.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

import java_build

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "protocols" / "golden"
WIRE_DTYPES = {"float32": "<f4", "float64": "<f8", "int8": "i1", "uint8": "u1", "int32": "<i4",
               "uint32": "<u4", "int64": "<i8", "uint64": "<u8"}
PRG_WORDS = 40

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


def canonical(obj) -> bytes:
    """Canonical JSON as docs/protocol.md defines it, written with the standard library."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def signed_envelope(key: Ed25519PrivateKey) -> tuple[bytes, dict[str, np.ndarray]]:
    """A signed message built from the spec by hand: one tensor of every wire dtype, a body with
    non-ASCII text, astral-plane keys, escapes and awkward numbers."""
    rng = np.random.default_rng(3)
    tensors = {"f32": rng.standard_normal((2, 3)).astype("<f4"),
               "f64": np.array([1e-310, -0.0, 1.7976931348623157e308, 0.1], "<f8"),
               "i8": np.array([-128, 127, -1], "i1"), "u8": np.arange(250, 256, dtype="u1"),
               "i32": np.array([[-2**31, 2**31 - 1]], "<i4"), "u32": np.array([2**32 - 1, 0, 2**31], "<u4"),
               "i64": np.array([-2**63, 2**63 - 1], "<i8"),
               "u64": np.array([2**64 - 1, 0, 2**63], "<u8"), "empty": np.zeros((0, 4), "<f4"),
               "scalar": np.array(2.5, "<f8")}
    descs, offset = [], 0
    for name, arr in tensors.items():
        descs.append({"name": name, "dtype": next(k for k, v in WIRE_DTYPES.items() if np.dtype(v) == arr.dtype),
                      "shape": list(arr.shape), "offset": offset, "nbytes": arr.nbytes})
        offset += arr.nbytes
    payload = b"".join(arr.tobytes() for arr in tensors.values())
    body = {"note": "Zürich \u2603 \U0001F600 \u2028 \x7f tab\t nl\n quote\" slash/ back\\ \x01",
            "\U0001F600": 1, "\uffff": 2, "é": [1.5e-7, 1e16, 1e15, 0.0001, -0.0, 123456789.125, 5e-324],
            "big": 2**64 - 1, "neg": -2**63, "nested": {"b": None, "a": [True, False, {}], "": []}}
    header = {"v": 1, "type": "result", "id": os.urandom(16).hex(), "sender": "dev-java.01", "ts": 1767225600.5,
              "body": body, "tensors": descs, "payload_sha256": hashlib.sha256(payload).hexdigest()}
    header["sig"] = key.sign(canonical(header)).hex()
    hbytes = canonical(header)
    return b"FFE1" + struct.pack("<I", len(hbytes)) + hbytes + payload, tensors


def canonical_lines() -> bytes:
    """Canonical JSON documents for the Java side to re-emit: many floats of every magnitude
    (float formatting is where implementations diverge) and tricky strings."""
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2**64, size=3000, dtype=np.uint64).view("<f8")
    floats = [float(x) for x in bits if math.isfinite(x)]
    floats += [float(x) for x in rng.standard_normal(500) * 10.0 ** rng.integers(-30, 30, 500)]
    floats += [float(np.float32(x)) for x in rng.standard_normal(300)]  # float32 tensors' values as JSON
    # every power of two: the gap below one is half the gap above, where a formatter that tries only
    # the half-even rounding at each length writes 17 digits (2^-24) instead of repr's 16
    floats += [s * 2.0 ** e for e in range(-1074, 1024) for s in (1, -1)]
    floats += [1e16, 9999999999999998.0, 1e-4, 9.999999999999999e-05, 1e22, 1e23, 2**53 + 2.0, 0.1 + 0.2]
    docs = [[floats[i:i + 200]] for i in range(0, len(floats), 200)]
    docs += [{"k\u00e9y": "\u0000\u001f\u007f\u0080\u07ff\u0800\uffff\U00010000\U0010ffff"},
             {"\U0001F600": 0, "\ufb01": 1, "a": {"z": 1, "B": 2, "_": 3}}]
    return b"\n".join(canonical(d) for d in docs) + b"\n"


@pytest.fixture(scope="module")
def java_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("java_conformance")
    cp = java_build.built()     # the device library's codec + this driver (Main.java)
    key = Ed25519PrivateKey.generate()
    signed, signed_tensors = signed_envelope(key)
    (tmp / "signed.bin").write_bytes(signed)
    (tmp / "canonical.jsonl").write_bytes(canonical_lines())
    seed = os.urandom(32)
    pub = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    proc = subprocess.run(java_build.java_command("-cp", cp, "Main", str(GOLDEN), "--signed", str(tmp / "signed.bin"),
                                                  pub, "--canonical", str(tmp / "canonical.jsonl"), "--prg",
                                                  seed.hex(), str(PRG_WORDS)),
                          capture_output=True, text=True, timeout=120)
    return {"proc": proc, "lines": proc.stdout.splitlines(), "seed": seed, "signed_tensors": signed_tensors}


def lines_starting(run, prefix: str) -> list[str]:
    return [line for line in run["lines"] if line.startswith(prefix)]


def test_java_codec_passes_every_check(java_run):
    proc = java_run["proc"]
    failed = lines_starting(java_run, "FAIL")
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-2000:])
    assert len(lines_starting(java_run, "PASS reject")) >= 35  # the corrupted variants really ran


def test_every_golden_vector_was_checked(java_run):
    index = json.loads((GOLDEN / "index.json").read_text())
    summary = lines_starting(java_run, "SUMMARY")
    signed = [name for name, entry in index.items() if "public_key" in entry]
    assert summary and f"golden={len(index)} signed={len(signed)} " in summary[0], summary
    assert signed, "the golden set must hold a signed vector"
    for name in signed:
        assert f"PASS golden {name} signature verifies" in java_run["lines"], name
    for name in index:
        assert f"PASS golden {name} re-encodes byte-identical" in java_run["lines"], name
        assert f"PASS golden {name} header == index.json" in java_run["lines"], name


def test_decoded_tensor_values_match_numpy(java_run):
    """Java's element values equal numpy's reading of the raw bytes at the header's offsets."""
    index = json.loads((GOLDEN / "index.json").read_text())
    seen = 0
    for line in lines_starting(java_run, "VALUES "):
        _, vector, name, dtype, values = line.split(" ", 4)
        if vector == "signed":
            expected = java_run["signed_tensors"][name].ravel()
        else:
            data = (GOLDEN / index[vector]["file"]).read_bytes()
            hlen = struct.unpack_from("<I", data, 4)[0]
            desc = next(d for d in index[vector]["header"]["tensors"] if d["name"] == name)
            start = 8 + hlen + desc["offset"]
            expected = np.frombuffer(data[start:start + desc["nbytes"]], dtype=WIRE_DTYPES[dtype])
        parse = float if dtype.startswith("float") else int
        got = [parse(v) for v in values.split(",") if v]
        assert len(got) == expected.size, (vector, name)
        assert all(g == e.item() and (parse is int or math.copysign(1, g) == math.copysign(1, e.item()))
                   for g, e in zip(got, expected)), (vector, name, got[:8], expected[:8])
        seen += 1
    assert seen >= 20


def test_java_verifies_a_signature_made_here(java_run):
    assert "PASS python-signed vector verifies" in java_run["lines"]
    assert "PASS python-signed vector re-encodes byte-identical" in java_run["lines"]


def test_java_re_emits_canonical_json_written_here(java_run):
    passed = [line for line in lines_starting(java_run, "PASS canonical JSON line")]
    assert len(passed) == canonical_lines().count(b"\n")


def test_mask_prg_matches_aes_ctr_from_cryptography(java_run):
    """docs/secure-aggregation.md: key = SHA-256(domain || seed)[:16]; AES-128-CTR keystream from a
    zero counter block, read as little-endian uint64."""
    key = hashlib.sha256(b"fedfleet/secagg/prg/v1" + java_run["seed"]).digest()[:16]
    stream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(8 * PRG_WORDS))
    expected = np.frombuffer(stream, dtype="<u8").tolist()
    got = [int(line.split()[2]) for line in lines_starting(java_run, "PRG ")]
    assert got == expected
