"""Two ModelSlots on one folder (a review's finding): the module docstring invites a second ``ModelSlot(dir)`` on the same folder (the application's own,
"predicts the same way as the device process that follows the rollouts"). A slot opened with
``local_labels`` reads slot.json, then rewrites it from what it read (``_commit``) and deletes
every ``*.npz`` it does not know. Nothing serialises the two: if the follower's swap lands between
the application's read and its commit, the application's stale commit

* puts slot.json back to the old version and the old ``seq`` (the deployment is silently undone on
  the next restart, and the replay guard forgets the sequence it held), and
* deletes the new head's file while the follower keeps running it, while the follower's commit
  already deleted the oldest head that the stale slot.json still names: the next
  ``ModelSlot(dir)`` raises FileNotFoundError (the device process cannot start).

The interleaving is made deterministic by running the follower's swap inside the application's
``_commit`` (what a context switch between the two processes does). Each commit now holds the
folder's lock and a labels-only commit re-reads the state under it.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from edge_client.deployment import ModelSlot
from protocols.payloads.deployment import head_npz


def _head(seed: int) -> tuple[bytes, str]:
    rng = np.random.default_rng(seed)
    data = head_npz(rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=3).astype(np.float32))
    return data, hashlib.sha256(data).hexdigest()


def test_an_application_slot_opened_during_a_swap_does_not_undo_it(tmp_path):
    (a, sha_a), (b, sha_b), (c, sha_c) = _head(1), _head(2), _head(3)
    follower = ModelSlot(tmp_path)
    follower.hold_seq(1)
    follower.swap(a, sha_a, "d1")
    follower.hold_seq(2)
    follower.swap(b, sha_b, "d2")

    class ApplicationSlot(ModelSlot):
        raced = False

        def _commit(self, current, previous, **kw):
            if not ApplicationSlot.raced:       # the follower's next rollout lands now
                ApplicationSlot.raced = True
                follower.hold_seq(3)
                follower.swap(c, sha_c, "d3")
            super()._commit(current, previous, **kw)

    ApplicationSlot(tmp_path, local_labels=[0, 1, 2])       # the app opens its slot, personalising
    assert follower.current.sha256 == sha_c                 # the follower runs C and reported it

    assert (tmp_path / f"{sha_c}.npz").exists(), "the running head's file was deleted by the other slot"
    try:
        restarted = ModelSlot(tmp_path)                     # the device process restarts
    except FileNotFoundError as exc:
        raise AssertionError(f"the slot cannot be opened any more (slot.json names a deleted head): {exc}") from exc
    assert restarted.current is not None and restarted.current.sha256 == sha_c, \
        f"after a restart the device runs {restarted.current.deployment}, not d3 (the swap was undone)"
    assert restarted.seq == 3, f"the replay guard went back from seq 3 to {restarted.seq}"


def test_a_swap_keeps_the_labels_the_application_saved_after_the_follower_opened(tmp_path):
    """The follower's slot, opened before the application personalised, wrote no labels back over
    the application's with its next swap (found reading this stop's change once more)."""
    (a, sha_a), (b, sha_b) = _head(1), _head(2)
    follower = ModelSlot(tmp_path)
    follower.swap(a, sha_a, "d1")
    ModelSlot(tmp_path, local_labels=[0, 2])                  # the application personalises
    follower.hold_seq(2)
    follower.swap(b, sha_b, "d2")
    reopened = ModelSlot(tmp_path)
    assert reopened.current.sha256 == sha_b and reopened.local_labels.tolist() == [0, 2]


def test_an_application_slot_opened_while_a_head_is_swapped_in_keeps_its_file(tmp_path):
    """A review's finding: the follower wrote the new head's file before taking the folder's lock,
    so an application slot opened in between deleted it as unnamed; the follower's commit then
    named a missing file and no slot on the folder could be opened again. The file is written
    under the lock now, with the state that names it."""
    (a, sha_a), (b, sha_b) = _head(1), _head(2)

    class FollowerSlot(ModelSlot):
        def _commit(self, current, previous, **kw):
            if current is not None and current.sha256 == sha_b:
                ModelSlot(tmp_path, local_labels=[0, 1])      # the application opens its slot now
            super()._commit(current, previous, **kw)

    follower = FollowerSlot(tmp_path)
    follower.swap(a, sha_a, "d1")
    follower.swap(b, sha_b, "d2")
    assert (tmp_path / f"{sha_b}.npz").exists()
    restarted = ModelSlot(tmp_path)
    assert restarted.current.sha256 == sha_b and restarted.local_labels.tolist() == [0, 1]


def test_a_slot_removes_only_the_head_files_it_wrote(tmp_path):
    """A review's finding: `fedfleet device --deployments DIR` deleted every *.npz of DIR that was
    not one of its two heads, at start-up with --personalize (the operator's best_model.npz went).
    A slot removes only a superseded <sha256>.npz it wrote; a slot.json that is not an object is
    one ValueError (it was an AttributeError)."""
    import pytest

    (a, sha_a), (b, sha_b), (c, sha_c) = _head(1), _head(2), _head(3)
    (tmp_path / "best_model.npz").write_bytes(b"the operator's")
    (tmp_path / ("0" * 64 + ".npy")).write_bytes(b"not a head file")
    slot = ModelSlot(tmp_path, local_labels=[0, 1])
    for seq, (data, sha, name) in enumerate(((a, sha_a, "d1"), (b, sha_b, "d2"), (c, sha_c, "d3")), start=1):
        slot.hold_seq(seq)
        slot.swap(data, sha, name)
    heads = sorted(p.name for p in tmp_path.glob("*.npz") if p.name != "best_model.npz")
    assert heads == sorted([f"{sha_b}.npz", f"{sha_c}.npz"])           # A superseded: removed
    assert (tmp_path / "best_model.npz").read_bytes() == b"the operator's"
    assert (tmp_path / ("0" * 64 + ".npy")).exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "slot.json").write_text("[]")
    with pytest.raises(ValueError, match="not a model slot's state"):
        ModelSlot(other)


@pytest.mark.parametrize("content,words", [
    ("[" * 100_000 + "]" * 100_000, "nest"),
    ('{"current": null, "previous": null, "seq": 1e400}', "overflows"),
    ('{"current": null, "previous": null, "seq": 2.9}', "seq"),
    ('{"current": null, "previous": null, "seq": true}', "seq"),
    ('{"current": null, "previous": null, "seq": 1, "seq": 2}', "duplicate"),
    ('{"current": null, "previous": null, "seq": 1, "local_labels": [[-5, 2.7]]}', "local_labels"),
    ('{"current": null, "previous": null, "seq": 1, "local_labels": [1e400]}', "overflows"),
    ('{"current": null, "previous": null, "seq": 1, "local_labels": [-1]}', "local_labels"),
    (None, "not a regular file")])
def test_a_slot_state_file_is_read_as_strictly_as_it_is_written(tmp_path, content, words):
    """A review's findings: slot.json was read with json.loads and int(): a FIFO hung the device,
    deep nesting was a RecursionError, 1e400 an OverflowError, a repeated key kept its last value,
    true and 2.9 were sequence 1 and 2, and [[-5, 2.7]] were labels. Each is one ValueError now."""
    import os
    import threading

    from edge_client.deployment import STATE_FILE, ModelSlot

    slot_dir = tmp_path / "slot"
    slot_dir.mkdir()
    if content is None:
        os.mkfifo(slot_dir / STATE_FILE)
    else:
        (slot_dir / STATE_FILE).write_text(content)
    outcome = []

    def open_slot():
        try:
            ModelSlot(slot_dir)
            outcome.append("opened")
        except ValueError as exc:
            outcome.append(str(exc))
    worker = threading.Thread(target=open_slot, daemon=True)
    worker.start()
    worker.join(10)
    assert outcome and words in outcome[0], outcome


def test_a_slot_state_naming_a_head_by_a_path_is_refused_not_read(tmp_path):
    """A version's sha256 names its head file: a slot.json whose sha256 was a path read whatever
    file it reached (only then refused, for its digest)."""
    from edge_client.deployment import STATE_FILE, ModelSlot

    (tmp_path / STATE_FILE).write_text('{"current": {"sha256": "../../etc/passwd", "deployment": "d"}, '
                                       '"previous": null, "seq": 1}')
    with pytest.raises(ValueError, match="current must be a version"):
        ModelSlot(tmp_path)
