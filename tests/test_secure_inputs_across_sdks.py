"""The secure-input ledger across the two SDKs (``edge_client/secure_inputs.py``, Java's
``SecureInputLedger``): the same input keys and member digests for the same inputs, byte for byte
(the golden vector ``protocols/golden/secure_inputs.json``, its keys rebuilt here from its
canonical texts by the spec alone), the same file, each device reading what the other wrote, and
the same refusal words. The Java side runs behind tests/java_device/SecureInputSteps.java."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import java_build
from edge_client.secure_inputs import (LOST_REASON, MAX_FILE_BYTES, MAX_INPUTS, OTHER_MEMBERS_REASON,
                                       SECURE_INPUTS_FILE, SecureInputLedger, input_key, member_digest, vector_key)
from protocols.envelope import parse_strict_json

GOLDEN = Path(__file__).resolve().parents[1] / "protocols" / "golden" / "secure_inputs.json"
java_only = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


def golden() -> dict:
    return parse_strict_json(GOLDEN.read_bytes())


def tensors_of(case: dict) -> dict[str, np.ndarray]:
    return {t["name"]: np.frombuffer(bytes.fromhex(t["hex"]), np.dtype(t["dtype"]).newbyteorder("<")).reshape(t["shape"])
            for t in case["tensors"]}


def test_the_golden_digests_follow_the_spec_and_python_computes_them():
    """Each key rebuilt by hashlib from the case's canonical texts (the documented construction),
    each member digest from the sorted ids; Python's functions give the same digests."""
    doc = golden()
    for case in doc["input_keys"]:
        assert [t["name"] for t in case["tensors"]] == sorted(t["name"] for t in case["tensors"])
        h = hashlib.sha256(case["head"].encode())
        for t in case["tensors"]:
            assert t["header"] == json.dumps([t["name"], t["dtype"], t["shape"]], separators=(",", ":"))
            h.update(t["header"].encode())
            h.update(bytes.fromhex(t["hex"]))
        assert h.hexdigest()[:32] == case["key"]
        assert input_key(case["kind"], case["params"], tensors_of(case)) == case["key"]
    assert doc["input_keys"][0]["key"] == doc["input_keys"][1]["key"]        # only the group differs
    for case in doc["vector_keys"]:
        raw = np.asarray(case["vector"], "<f8")
        h = hashlib.sha256(json.dumps({"kind": case["kind"], "params": {}}, separators=(",", ":")).encode())
        h.update(f'["input","float64",[{len(raw)}]]'.encode() + raw.tobytes())
        assert h.hexdigest()[:32] == case["key"] == vector_key(case["kind"], np.asarray(case["vector"]))
    for case in doc["member_digests"]:
        assert hashlib.sha256("\n".join(sorted(case["members"])).encode()).hexdigest()[:32] == case["digest"]
        assert member_digest(reversed(case["members"])) == case["digest"]


def test_python_writes_the_golden_file(tmp_path):
    doc = golden()
    ledger = SecureInputLedger(tmp_path / SECURE_INPUTS_FILE)
    assert ledger.release(doc["input_keys"][0]["key"]).masked_input(frozenset(doc["member_digests"][0]["members"])) is None
    assert ledger.release(doc["vector_keys"][0]["key"]).masked_input(frozenset(doc["member_digests"][1]["members"])) is None
    assert (tmp_path / SECURE_INPUTS_FILE).read_text() == doc["file"]


class JavaLedger:
    """tests/java_device/SecureInputSteps.java: one command a line, one answer a line."""

    def __init__(self):
        self.proc = subprocess.Popen(java_build.java_command("-cp", java_build.built(), "SecureInputSteps"),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, encoding="utf-8")

    def step(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()[-3000:]
        return line.rstrip("\n")

    def close(self):
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0, self.proc.stderr.read()[-3000:]


@java_only
def test_java_computes_the_golden_digests_file_and_words():
    doc = golden()
    java = JavaLedger()
    try:
        got = json.loads(java.step(f"golden {GOLDEN}"))
    finally:
        java.close()
    assert got["input_keys"] == [c["key"] for c in doc["input_keys"]]
    assert got["vector_keys"] == [c["key"] for c in doc["vector_keys"]]
    assert got["member_digests"] == [c["digest"] for c in doc["member_digests"]]
    assert got["file"] == doc["file"]
    assert (got["other_members"], got["lost"]) == (OTHER_MEMBERS_REASON, LOST_REASON)
    assert (got["max_inputs"], got["max_file_bytes"]) == (MAX_INPUTS, MAX_FILE_BYTES)


@java_only
def test_each_device_keeps_the_rule_on_what_the_other_wrote(tmp_path):
    """A Python device's ledger, then a Java device's on the same state folder, then the Python
    one's again: each refuses another member set for an input the other bound, and both write the
    same bytes for the same steps. A file neither can read fails closed in the same words."""
    first, second = "1" * 32, "2" * 32
    ledger = SecureInputLedger(tmp_path / SECURE_INPUTS_FILE)
    release = ledger.release(first)
    assert release.masked_input(frozenset("abcd")) is None and release.unmask(frozenset("abc")) is None
    java = JavaLedger()
    try:
        steps = [("open", str(tmp_path)), ("release", first), ("masked", "a,b,c,d"), ("release", first),
                 ("masked", "a,b,c"), ("unmask", "a,b,c"), ("release", second), ("masked", "x,y,z"), ("unmask", "x,y")]
        answers = [java.step(f"{command} {arg}") for command, arg in steps]
        damaged = tmp_path / "damaged"
        damaged.mkdir()
        (damaged / SECURE_INPUTS_FILE).write_text('{"inputs": [["a", "b"]]}')
        lost = [java.step(f"open {damaged}"), java.step("release " + first), java.step("masked a,b,c")]
    finally:
        java.close()
    assert answers == ["OK"] * 2 + [f"REFUSED {OTHER_MEMBERS_REASON}"] + ["OK"] * 6
    again = SecureInputLedger(tmp_path / SECURE_INPUTS_FILE)
    assert again.kept(first) == member_digest("abc") and again.kept(second) == member_digest("xy")
    assert again.release(second).masked_input(frozenset("xyz")) == OTHER_MEMBERS_REASON
    python = tmp_path / "python"
    python.mkdir()
    same = SecureInputLedger(python / SECURE_INPUTS_FILE)
    for key, participants, survivors in ((first, "abcd", "abc"), (second, "xyz", "xy")):
        release = same.release(key)
        assert release.masked_input(frozenset(participants)) is None and release.unmask(frozenset(survivors)) is None
    assert (python / SECURE_INPUTS_FILE).read_bytes() == (tmp_path / SECURE_INPUTS_FILE).read_bytes()
    assert lost == ["OK", "OK", f"REFUSED {LOST_REASON}"]
    assert SecureInputLedger(damaged / SECURE_INPUTS_FILE).release(first).masked_input(frozenset("abc")) == LOST_REASON


@java_only
def test_both_sdks_fix_the_set_kept_once_another_round_sent_on_it(tmp_path):
    """Two rounds of one input at once: the first round's masked input keeps a, b, c, d; the second's
    leaves on that set. The first may no longer narrow the set to its survivors a, b, c (the second
    may be revealed over a, b, c, d: the two sums' difference would be d's input); the second is
    answered over the set kept. Python and Java give the same answers, in the same words."""
    key = "3" * 32
    steps = [("release", key), ("masked", "a,b,c,d"), ("release", key), ("masked", "a,b,c,d"),
             ("switch", "0"), ("unmask", "a,b,c"), ("switch", "1"), ("unmask", "a,b,c,d")]
    ledger = SecureInputLedger(tmp_path / SECURE_INPUTS_FILE)
    guards, guard, python = [], None, []
    for command, arg in steps:
        if command == "release":
            guard = ledger.release(arg)
            guards.append(guard)
        elif command == "switch":
            guard = guards[int(arg)]
        refusal = {"masked": lambda: guard.masked_input(frozenset(arg.split(","))),
                   "unmask": lambda: guard.unmask(frozenset(arg.split(",")))}.get(command, lambda: None)()
        python.append("OK" if refusal is None else f"REFUSED {refusal}")
    (tmp_path / "java").mkdir()
    java = JavaLedger()
    try:
        answers = [java.step(f"open {tmp_path / 'java'}")] + [java.step(f"{command} {arg}") for command, arg in steps]
    finally:
        java.close()
    expected = ["OK"] * 5 + [f"REFUSED {OTHER_MEMBERS_REASON}"] + ["OK"] * 2
    assert python == expected and answers == ["OK", *expected]
    assert ledger.kept(key) == member_digest("abcd")
