"""The secure-input ledger across the two SDKs (``edge_client/secure_inputs.py``, Java's
``SecureInputLedger``): the same input keys and member digests for the same inputs, byte for byte
(the golden vector ``protocols/golden/secure_inputs.json``, its keys rebuilt here from its
canonical texts by the spec alone), the same file, each device reading what the other wrote, and
the same refusal words. The Java side runs behind tests/java_device/SecureInputSteps.java."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import java_build
from edge_client.secure_inputs import (FORGOTTEN_REASON, LOST_REASON, MAX_FILE_BYTES, MAX_INPUTS, OTHER_MEMBERS_REASON,
                                       SECURE_INPUTS_FILE, SecureInputLedger, forgotten_positions, input_key,
                                       member_digest, vector_key)
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


def pushed_key(prefix: str, i: int) -> str:
    return hashlib.sha256(f"{prefix} {i}".encode()).hexdigest()[:32]


def push(ledger, n: int, prefix: str, members=frozenset("abc")) -> str | None:
    """What the Java driver's ``push`` does: n other inputs kept (the oldest pushed out); the first refusal."""
    for i in range(n):
        refusal = ledger.release(pushed_key(prefix, i)).masked_input(members)
        if refusal is not None:
            return refusal
    return None


def test_the_golden_forgotten_filter_follows_the_spec(tmp_path):
    """Positions rebuilt from the key as a 128-bit number (seven 20-bit slices from the top, the
    last wrapping to its first bits), the filter's bytes from the positions (bit p: byte p // 8,
    value 1 << p % 8), the file from the documented text; Python's ledger writes that file."""
    doc, forgotten = golden(), golden()["forgotten"]
    for case in forgotten["cases"]:
        value = int(case["key"], 16)
        rotated = value << 128 | value
        assert case["positions"] == [rotated >> (256 - 20 * (i + 1)) & 0xFFFFF for i in range(7)]
        assert forgotten_positions(case["key"]) == case["positions"]
    bits = bytearray(2 ** 20 // 8)
    for p in forgotten["cases"][0]["positions"]:
        bits[p // 8] |= 1 << p % 8
    assert forgotten["filter_bytes"] == [[i, b] for i, b in enumerate(bits) if b]
    second = member_digest(doc["member_digests"][1]["members"])
    text = json.dumps({"forgotten": base64.b64encode(bits).decode(),
                       "inputs": [[pushed_key("push", i), second] for i in range(forgotten["pushed"])]},
                      separators=(",", ":")).encode()
    assert (hashlib.sha256(text).hexdigest(), len(text)) == (forgotten["file_sha256"], forgotten["file_bytes"])
    assert len(text) <= MAX_FILE_BYTES
    ledger = SecureInputLedger(tmp_path / SECURE_INPUTS_FILE)
    first = forgotten["cases"][0]["key"]
    assert ledger.release(first).masked_input(frozenset(doc["member_digests"][0]["members"])) is None
    assert push(ledger, MAX_INPUTS, "push", frozenset(doc["member_digests"][1]["members"])) is None
    assert (tmp_path / SECURE_INPUTS_FILE).read_bytes() == text
    assert SecureInputLedger(tmp_path / SECURE_INPUTS_FILE).release(first).masked_input(frozenset("x")) == FORGOTTEN_REASON


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
    assert got["forgotten"] == got["forgotten_file_refuses_it"] == FORGOTTEN_REASON
    assert got["forgotten_positions"] == [c["positions"] for c in doc["forgotten"]["cases"]]
    assert got["forgotten_bytes"] == doc["forgotten"]["filter_bytes"]
    assert got["forgotten_file_sha256"] == doc["forgotten"]["file_sha256"]


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


def python_steps(steps) -> list[str]:
    """The Java driver's steps (open, release, masked, unmask, push) on a Python ledger."""
    ledger = guard = None
    answers = []
    for command, arg in steps:
        refusal = None
        if command == "open":
            ledger = SecureInputLedger(Path(arg) / SECURE_INPUTS_FILE)
        elif command == "release":
            guard = ledger.release(arg)
        elif command == "masked":
            refusal = guard.masked_input(frozenset(arg.split(",")))
        elif command == "unmask":
            refusal = guard.unmask(frozenset(arg.split(",")))
        else:
            n, prefix = arg.split(" ", 1)
            refusal = push(ledger, int(n), prefix)
        answers.append("OK" if refusal is None else f"REFUSED {refusal}")
    return answers


def java_steps(steps) -> list[str]:
    java = JavaLedger()
    try:
        return [java.step(f"{command} {arg}") for command, arg in steps]
    finally:
        java.close()


@java_only
def test_both_sdks_never_send_an_input_pushed_out_of_the_ledger_again(tmp_path):
    """The eviction attack on each SDK: x revealed over a, b, c; 1,024 other inputs push it out of
    the ledger (MAX_INPUTS); x offered again, over other members or its own, is refused in the same
    words (it used to be taken for a new input). Both write the same file, filter included."""
    x = "5" * 32
    (tmp_path / "python").mkdir()
    (tmp_path / "java").mkdir()
    steps = lambda folder: [("open", str(folder)), ("release", x), ("masked", "a,b,c,d"), ("unmask", "a,b,c"),  # noqa: E731
                            ("push", f"{MAX_INPUTS} other"), ("release", x), ("masked", "a,b,d"),
                            ("release", x), ("masked", "a,b,c")]
    expected = ["OK"] * 6 + [f"REFUSED {FORGOTTEN_REASON}", "OK", f"REFUSED {FORGOTTEN_REASON}"]
    assert python_steps(steps(tmp_path / "python")) == expected
    assert java_steps(steps(tmp_path / "java")) == expected
    written = (tmp_path / "python" / SECURE_INPUTS_FILE).read_bytes()
    assert b'"forgotten":"' in written and written == (tmp_path / "java" / SECURE_INPUTS_FILE).read_bytes()


@java_only
def test_each_device_reads_the_others_forgotten_filter(tmp_path):
    """A file with a filter written by one SDK, read by the other: the forgotten input refused, a
    new one kept, and the rewrite byte for byte what the writer itself writes for the same step.
    A malformed filter fails closed in both (LOST_REASON)."""
    x = "6" * 32
    for writer, reader in (("python", "java"), ("java", "python")):
        made, own, other = tmp_path / writer, tmp_path / f"{writer}-again", tmp_path / f"{writer}-by-{reader}"
        made.mkdir()
        first = [("open", str(made)), ("release", x), ("masked", "a,b,c"), ("push", f"{MAX_INPUTS} {writer}")]
        assert (python_steps if writer == "python" else java_steps)(first) == ["OK"] * 4
        shutil.copytree(made, own)
        shutil.copytree(made, other)
        then = lambda folder: [("open", str(folder)), ("release", x), ("masked", "a,b,c"),  # noqa: E731
                               ("release", "7" * 32), ("masked", "x,y")]
        expected = ["OK", "OK", f"REFUSED {FORGOTTEN_REASON}", "OK", "OK"]
        assert (python_steps if writer == "python" else java_steps)(then(own)) == expected
        assert (java_steps if writer == "python" else python_steps)(then(other)) == expected
        assert (own / SECURE_INPUTS_FILE).read_bytes() == (other / SECURE_INPUTS_FILE).read_bytes()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    text = (tmp_path / "python" / SECURE_INPUTS_FILE).read_text()
    at = text.index('"forgotten":"') + len('"forgotten":"')
    bad = text[:at] + "*" + text[at + 1:]                  # one character out of the alphabet, the length kept
    (damaged / SECURE_INPUTS_FILE).write_text(bad)
    steps = [("open", str(damaged)), ("release", "8" * 32), ("masked", "a,b")]
    assert java_steps(steps) == python_steps(steps) == ["OK", "OK", f"REFUSED {LOST_REASON}"]
    assert (damaged / SECURE_INPUTS_FILE).read_text() == bad
