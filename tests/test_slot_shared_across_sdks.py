"""A Python and a Java slot on one folder (the application's own slot beside the device's
follower, each in either language): they take one lock, and a commit reads again what the other
wrote. Before, the Java slot took no lock at all (the Python one took an ``flock``, which a Java
``FileChannel.lock`` does not see on Linux) and wrote what it had read at its start: a Java swap
put back a lower sequence than the one the Python follower held (the replay guard forgot it) and
dropped the labels the Python application had saved. Both now take a POSIX record lock on
``.slot.lock`` (``fcntl.lockf``; ``FileChannel.lock``) and follow the Python slot's rules for
what another slot wrote (tests/test_model_slot_shared.py: two Python slots)."""

from __future__ import annotations

import hashlib
import queue
import subprocess
import threading

import numpy as np
import pytest

import java_build
from edge_client.deployment import ModelSlot, _FolderLock
from protocols.payloads.deployment import head_npz

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


def _head(seed: int) -> tuple[bytes, str]:
    rng = np.random.default_rng(seed)
    data = head_npz(rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=3).astype(np.float32))
    return data, hashlib.sha256(data).hexdigest()


class JavaSlot:
    """tests/java_device/SlotSteps.java on ``folder``: one line in, one line out."""

    def __init__(self, folder, labels: str | None = None):
        self.proc = subprocess.Popen(["java", "-cp", java_build.built(), "SlotSteps", str(folder),
                                      *([labels] if labels else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line.strip()) for line in self.proc.stdout], daemon=True).start()

    def line(self, timeout: float = 60.0) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from the Java slot in {timeout}s") from None

    def step(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.line()

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0, self.proc.stderr.read()


def test_a_java_slot_waits_for_the_folder_lock_a_python_slot_holds(tmp_path):
    (a, sha_a), tmp_path = _head(1), tmp_path / "slot"
    ModelSlot(tmp_path).swap(a, sha_a, "d1")
    java = None
    with _FolderLock(tmp_path):                     # a Python slot mid-commit
        java = JavaSlot(tmp_path, "0,2")            # the application opens its slot, personalising
        with pytest.raises(AssertionError, match="no line"):
            java.line(timeout=3.0)                  # it waits: its labels-only commit needs the lock
    try:
        assert java.line() == "OPENED"
        assert java.step("state") == f"STATE 0 [0,2] {sha_a}"
        assert ModelSlot(tmp_path).local_labels.tolist() == [0, 2]
    finally:
        java.close()


def test_a_java_swap_keeps_the_sequence_and_labels_python_slots_saved_after_it_opened(tmp_path):
    (a, sha_a), (b, sha_b), (c, sha_c) = _head(1), _head(2), _head(3)
    (tmp_path / "c.npz").write_bytes(c)
    tmp_path = tmp_path / "slot"
    follower = ModelSlot(tmp_path)
    follower.hold_seq(3)
    follower.swap(a, sha_a, "d1")
    java = JavaSlot(tmp_path)
    try:
        assert java.line() == "OPENED" and java.step("state") == f"STATE 3 none {sha_a}"
        follower.hold_seq(7)                        # the follower moves on meanwhile
        follower.swap(b, sha_b, "d2")
        ModelSlot(tmp_path, local_labels=[0, 2])    # and the application personalises
        assert java.step(f"swap {tmp_path.parent / 'c.npz'} {sha_c} d3") == f"SWAPPED {sha_c}"
        assert java.step("state") == f"STATE 7 [0,2] {sha_c}"
    finally:
        java.close()
    reopened = ModelSlot(tmp_path)
    assert reopened.seq == 7, "the replay guard went back to the sequence the Java slot had read"
    assert reopened.local_labels.tolist() == [0, 2] and reopened.current.sha256 == sha_c
