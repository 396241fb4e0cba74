"""The Python and the Java device open a model slot's folder alike (a review's finding: either
library opens a slot the other wrote, yet Java read ``slot.json`` without Python's checks): the same
files are the same slot, or a refusal, on both. Java took a 2^63 sequence as a negative one, let a
label of 2.7 or a deployment named 5 escape as a ClassCastException, read a 64 MiB slot.json and
would block for ever on a FIFO in its place, and took integers past the wire's range and bytes that
are not UTF-8 (replaced); Python took any ``seq_key``."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

import java_build
from edge_client.deployment import ModelSlot
from protocols.payloads.deployment import head_npz

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

HEAD = head_npz(np.arange(6, dtype=np.float32).reshape(2, 3), np.array([0.5, -1.0], np.float32))
SHA = __import__("hashlib").sha256(HEAD).hexdigest()
VERSION = {"sha256": SHA, "deployment": "dep-1", "bundle_sha256": ""}
VALID = {"current": VERSION, "previous": None, "local_labels": [0, 1], "seq": 7, "seq_key": "ab" * 32}

SLOTS = {
    "valid": VALID,
    "valid, written before sequences named their key": {k: v for k, v in VALID.items() if k != "seq_key"},
    "valid, empty": {"current": None, "previous": None, "local_labels": None, "seq": 0},
    "valid, no bundle named": {**VALID, "current": {"sha256": SHA, "deployment": "dep-1"}},
    "seq past a long": {**VALID, "seq": 2 ** 63},
    "seq past 2^62": {**VALID, "seq": 2 ** 62 + 1},
    "negative seq": {**VALID, "seq": -1},
    "seq a number with a point": {**VALID, "seq": 7.0},
    "seq a string": {**VALID, "seq": "7"},
    "seq null": {**VALID, "seq": None},
    "seq_key a number": {**VALID, "seq_key": 5},
    "seq_key not a sha256": {**VALID, "seq_key": "../key"},
    "a label with a point": {**VALID, "local_labels": [0, 2.7]},
    "a negative label": {**VALID, "local_labels": [-5]},
    "a label past an int": {**VALID, "local_labels": [2 ** 31]},
    "labels not a list": {**VALID, "local_labels": "01"},
    "a deployment named by a number": {**VALID, "current": {**VERSION, "deployment": 5}},
    "a bundle named by a number": {**VALID, "current": {**VERSION, "bundle_sha256": 5}},
    "a version's sha256 a path": {**VALID, "current": {**VERSION, "sha256": "../" + SHA[3:]}},
    "a version an empty object": {**VALID, "previous": {}},
    "a version a number": {**VALID, "previous": 0},
    "not an object": [VALID],
    "an integer past the wire's range anywhere": {**VALID, "note": 2 ** 64},
    "an integer past the wire's range in a version": {**VALID, "current": {**VERSION, "note": -(2 ** 63) - 1}},
    "valid, the wire's largest integer anywhere": {**VALID, "note": 2 ** 64 - 1},
    "a byte that is not UTF-8 in a string": json.dumps({**VALID, "current": {**VERSION, "deployment": "dep-\x01"}})
                                            .replace("\\u0001", "\udcff").encode("utf-8", "surrogateescape"),
}


def write_slot(folder, state) -> None:
    folder.mkdir()
    (folder / f"{SHA}.npz").write_bytes(HEAD)
    (folder / "slot.json").write_bytes(state if isinstance(state, bytes) else
                                       (state if isinstance(state, str) else json.dumps(state)).encode())


def python_decision(folder) -> str:
    try:
        slot = ModelSlot(folder)
    except (ValueError, OSError) as exc:
        return f"REFUSED {exc}"
    labels = "none" if slot.local_labels is None else "[" + ",".join(map(str, slot.local_labels.tolist())) + "]"
    return f"OK {slot.seq} {labels} {'none' if slot.current is None else slot.current.sha256}"


def test_the_python_and_java_devices_open_the_same_slot_folders_alike(tmp_path):
    folders = {}
    for k, (name, state) in enumerate(SLOTS.items()):
        write_slot(folders.setdefault(name, tmp_path / f"slot{k}"), state)
    folders["larger than a slot's state"] = tmp_path / "large"
    write_slot(folders["larger than a slot's state"], json.dumps(VALID) + " " * (1 << 20))
    folders["slot.json a FIFO"] = tmp_path / "fifo"
    folders["slot.json a FIFO"].mkdir()
    os.mkfifo(folders["slot.json a FIFO"] / "slot.json")
    folders["slot.json a folder"] = tmp_path / "folder"
    (folders["slot.json a folder"] / "slot.json").mkdir(parents=True)
    proc = subprocess.run(java_build.java_command("-cp", java_build.built(), "SlotFiles"),
                          input="\n".join(map(str, folders.values())) + "\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    java = dict(zip(folders, proc.stdout.splitlines()))
    python = {name: python_decision(folder) for name, folder in folders.items()}
    verdicts = {name: (python[name].split()[0], java[name].split()[0]) for name in folders}
    assert verdicts == {name: ("OK", "OK") if name.startswith("valid") else ("REFUSED", "REFUSED") for name in folders}, \
        {name: (python[name][:140], java[name][:140]) for name in folders}
    assert {name: python[name] for name in folders if name.startswith("valid")} == \
        {name: java[name] for name in folders if name.startswith("valid")}
    assert python["valid"] == f"OK 7 [0,1] {SHA}"
