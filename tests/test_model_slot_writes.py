"""The model slot's atomic writes on a failing disk: a head written to a full disk leaves no partial
file (a retry is not starved of space), and a folder that refuses fsync does not fail a
replacement already made."""

import hashlib
import os

import numpy as np
import pytest

from edge_client.deployment import ModelSlot
from protocols.payloads import deployment as D


def test_a_head_written_to_a_full_disk_leaves_no_partial_file(tmp_path, monkeypatch):
    """The slot's atomic write (``protocols.files.write_atomic``, the state store's too) fails
    (ENOSPC at the sync): its temp file is removed, so a retry is not starved of the space the
    failed attempt took (each attempt used to leave one behind), and the old file stays."""
    import errno
    import os

    from protocols import files

    (tmp_path / "head.npz").write_bytes(b"old")
    slot, head = ModelSlot(tmp_path / "slot"), D.head_npz(np.zeros((3, 4), np.float32), np.zeros(3, np.float32))
    kept = sorted(set(os.listdir(tmp_path / "slot")) - {".slot.lock"})

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        slot.swap(head, hashlib.sha256(head).hexdigest(), "d1")
    with pytest.raises(OSError, match="No space"):
        files.write_atomic(tmp_path / "head.npz", b"x" * 1000)
    assert sorted(os.listdir(tmp_path)) == ["head.npz", "slot"] and (tmp_path / "head.npz").read_bytes() == b"old"
    # nothing partial is left (the folder's lock file, made by the commit that failed, is no head)
    assert sorted(set(os.listdir(tmp_path / "slot")) - {".slot.lock"}) == kept and slot.current is None


def test_a_folder_that_refuses_fsync_does_not_fail_a_replacement_already_made(tmp_path, monkeypatch):
    """Some filesystems refuse fsync on a folder (EINVAL) or the folder cannot be opened: the
    rename is done by then, so ``write_atomic`` returns (as PostgreSQL's fsync_fname does) and the
    slot swaps in memory too; it used to raise after the new head was already on disk."""
    import errno
    import stat

    from protocols import files

    real_fsync, real_fstat = files.os.fsync, os.fstat

    def refusing(fd):
        if stat.S_ISDIR(real_fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fsync(fd)
    monkeypatch.setattr(files.os, "fsync", refusing)
    slot, head = ModelSlot(tmp_path / "slot"), D.head_npz(np.zeros((3, 4), np.float32), np.zeros(3, np.float32))
    slot.swap(head, hashlib.sha256(head).hexdigest(), "d1")
    assert slot.current.deployment == "d1" and ModelSlot(tmp_path / "slot").current.deployment == "d1"
