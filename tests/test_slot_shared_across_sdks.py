"""A Python and a Java slot on one folder (the application's own slot beside the device's
follower, each in either language): they take one lock, and a commit reads again what the other
wrote. Before, the Java slot took no lock at all (the Python one took an ``flock``, which a Java
``FileChannel.lock`` does not see on Linux) and wrote what it had read at its start: a Java swap
put back a lower sequence than the one the Python follower held (the replay guard forgot it) and
dropped the labels the Python application had saved. Both now take a POSIX record lock on
``.slot.lock`` (``fcntl.lockf``; ``FileChannel.lock``) and follow the Python slot's rules for
what another slot wrote (tests/test_model_slot_shared.py: two Python slots). A review of that
change found the rest below: read-only folders, forks, labels saved since a swap was judged, and a
slot of no key writing over a keyed one."""

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
        self.proc = subprocess.Popen(java_build.java_command("-cp", java_build.built(), "SlotSteps", str(folder),
                                                             *([labels] if labels else [])),
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


def _head_of(classes: int, seed: int) -> tuple[bytes, str]:
    rng = np.random.default_rng(seed)
    data = head_npz(rng.normal(size=(classes, 4)).astype(np.float32), rng.normal(size=classes).astype(np.float32))
    return data, hashlib.sha256(data).hexdigest()


def test_a_swap_is_refused_when_labels_saved_since_name_a_class_its_head_lacks(tmp_path):
    """A review's finding: a follower opened before the application personalised took the saved
    labels at its next commit without checking its new head against them; a head of fewer classes
    was written, and every prediction after it failed. Now that swap is refused, nothing changed,
    in both SDKs (as a slot opened after the labels refuses it)."""
    (six, sha_six), (three, sha_three) = _head_of(6, 1), _head_of(3, 2)
    (tmp_path / "three.npz").write_bytes(three)
    for sdk in ("python", "java"):
        slot_dir = tmp_path / sdk
        ModelSlot(slot_dir).swap(six, sha_six, "d1")
        follower = ModelSlot(slot_dir) if sdk == "python" else JavaSlot(slot_dir)
        try:
            if sdk == "java":
                assert follower.line() == "OPENED"
            ModelSlot(slot_dir, local_labels=[0, 5])            # the application personalises
            if sdk == "python":
                with pytest.raises(ValueError, match="local labels"):
                    follower.swap(three, sha_three, "d2")
            else:
                assert follower.step(f"swap {tmp_path / 'three.npz'} {sha_three} d2").startswith("REFUSED local labels")
        finally:
            if sdk == "java":
                follower.close()
        reopened = ModelSlot(slot_dir)
        assert reopened.current.sha256 == sha_six and reopened.local_labels.tolist() == [0, 5], sdk
        assert not (slot_dir / f"{sha_three}.npz").exists(), sdk


def test_a_slot_of_no_key_keeps_the_key_and_sequence_a_keyed_slot_saved_since(tmp_path):
    """A review's finding: two slots opened on a slot.json written before sequences named their key;
    the follower bound its key and held a higher sequence; the other slot's next commit wrote its own
    lower sequence back, without the key, and a restarted follower took replays of the sequences
    between. Now a slot of no key takes the key and sequence saved since (both SDKs)."""
    import json

    (a, sha_a), (b, sha_b) = _head(1), _head(2)
    (tmp_path / "b.npz").write_bytes(b)
    for sdk in ("python", "java"):
        slot_dir = tmp_path / sdk
        slot_dir.mkdir()
        (slot_dir / f"{sha_a}.npz").write_bytes(a)
        (slot_dir / "slot.json").write_text(json.dumps({"current": {"sha256": sha_a, "deployment": "d1"},
                                                        "previous": None, "local_labels": None, "seq": 5}))
        other = ModelSlot(slot_dir) if sdk == "python" else JavaSlot(slot_dir)
        try:
            if sdk == "java":
                assert other.line() == "OPENED"
            follower = ModelSlot(slot_dir)
            follower.bind_key(b"k" * 32)
            follower.hold_seq(9)
            if sdk == "python":
                other.swap(b, sha_b, "d2")
            else:
                assert other.step(f"swap {tmp_path / 'b.npz'} {sha_b} d2") == f"SWAPPED {sha_b}"
        finally:
            if sdk == "java":
                other.close()
        saved = json.loads((slot_dir / "slot.json").read_text())
        assert (saved["seq"], saved.get("seq_key")) == (9, hashlib.sha256(b"k" * 32).hexdigest()), sdk
        assert saved["current"]["sha256"] == sha_b, sdk


def _read_only(folder) -> list[str]:
    """A command prefix that runs what follows with ``folder`` read-only: a read-only bind mount of
    it in a mount namespace of its own (root: a permission bit does not stop root), else the folder
    is made read-only for this user."""
    import os
    import shutil

    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        return []
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a folder read-only as root")
    return ["unshare", "--mount", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(folder)]


@pytest.mark.parametrize("lock_file", [True, False], ids=["with its lock file", "written before lock files"])
def test_a_slot_on_a_folder_this_process_may_only_read_opens_in_both_sdks(tmp_path, lock_file):
    """A review's finding: taking the folder's lock opened .slot.lock for writing, so an application
    reading its slot from a read-only mount (or as another user) could no longer open it at all. It
    now takes a shared lock there, or none where no lock file exists (nothing writes that folder)."""
    import subprocess
    import sys

    from ops_fleet import REPO

    (a, sha_a), slot_dir = _head(1), tmp_path / "slot"
    ModelSlot(slot_dir).swap(a, sha_a, "d1")
    if not lock_file:
        (slot_dir / ".slot.lock").unlink()
    prefix = _read_only(slot_dir)
    probe = subprocess.run([*prefix, "touch", str(slot_dir / "probe")], capture_output=True, text=True)
    if probe.returncode == 0:
        pytest.skip("this machine would not make the folder read-only")
    python = subprocess.run([*prefix, sys.executable, "-c", "import sys; from edge_client.deployment import ModelSlot; "
                             "print(ModelSlot(sys.argv[1]).current.sha256)", str(slot_dir)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    java = subprocess.run([*prefix, *java_build.java_command("-cp", java_build.built(), "SlotFiles")],
                          input=f"{slot_dir}\n",
                          capture_output=True, text=True, timeout=120)
    assert python.stdout.strip() == sha_a, python.stderr[-2000:]
    assert java.stdout.strip() == f"OK 0 none {sha_a}", java.stdout + java.stderr[-2000:]


def test_a_child_forked_while_a_thread_held_the_folder_lock_opens_its_slot(tmp_path):
    """A review's finding: the per-folder threading lock was copied into a child forked while the
    follower's thread held it, locked, with no thread to release it: any slot the child opened on
    that folder waited for ever. A fresh Python process here: a thread holds the lock, the process
    forks, the thread lets go, and the child opens its slot."""
    import subprocess
    import sys

    from ops_fleet import REPO

    (a, sha_a), slot_dir = _head(1), tmp_path / "slot"
    ModelSlot(slot_dir).swap(a, sha_a, "d1")
    script = """
import os, sys, threading, time
from pathlib import Path
from edge_client.deployment import ModelSlot, _FolderLock
folder, held, go = Path(sys.argv[1]), threading.Event(), threading.Event()
def hold():
    with _FolderLock(folder):
        held.set()
        go.wait()
threading.Thread(target=hold).start()
held.wait()
pid = os.fork()
if pid == 0:
    print("child opened", ModelSlot(folder).current.sha256, flush=True)
    os._exit(0)
time.sleep(0.5)
go.set()
os.waitpid(pid, 0)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(slot_dir)], capture_output=True, text=True, timeout=30,
                          cwd=REPO)
    assert proc.stdout.strip() == f"child opened {sha_a}", proc.stderr[-2000:]
