"""Contribution payloads as files beside the store's SQLite file (``<db>.blobs/<seq>.msg``).

Real SQLite, real files, a real process SIGKILLed between a payload file and its row's commit
(the ``contribution_file_written`` crash point): the bytes read back are the bytes stored, a
committed row always has its file, a file of no row is deleted at open, deleting rows (forget,
quarantine) deletes their files, a version 1 store (payloads in the table) is migrated, and no
device-chosen id ever names a file.
"""

import logging
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from aggregator.storage.store import Store, StoreError
from aggregator.storage.schema import CONTRIBUTIONS, SCHEMA, SCHEMA_VERSION

from ops_fleet import REPO


def new_store(path, job="j"):
    store = Store(path)
    store.create_job(job, "fed3r", {})
    store.open_round(job, 1, [], {}, {}, time.time() + 60)
    return store


def stored_files(tmp_path):
    """Every file under tmp_path, relative, with its bytes."""
    return {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}


def payload_files(blobs):
    """The blob directory's files that hold bytes (not the empty spares whose names are made durable ahead)."""
    return {name: data for name, data in stored_files(blobs).items() if data}


def holds(files: dict, data: bytes) -> list[str]:
    return [name for name, content in files.items() if data in content]


def test_payloads_are_files_named_by_seq_and_read_back_exactly(tmp_path):
    store = new_store(tmp_path / "state.db")
    payloads = {"dev01": b"", "dev02": b"x", "dev03": os.urandom(300_000)}          # b"": a spare's size
    seqs = {d: store.add_contribution("j", 1, d, f"m-{d}", p) for d, p in payloads.items()}
    got = {c.device: (c.seq, c.payload) for c in store.contributions("j")}
    assert got == {d: (seqs[d], p) for d, p in payloads.items()}
    for d, seq in seqs.items():
        assert (tmp_path / "state.db.blobs" / f"{seq:012d}.msg").read_bytes() == payloads[d]
    # the bytes are in their file only, not in the database or its WAL
    assert holds(stored_files(tmp_path), payloads["dev03"][1000:1064]) == [f"state.db.blobs/{seqs['dev03']:012d}.msg"]
    # a duplicate changes nothing on disk
    before = stored_files(tmp_path / "state.db.blobs")
    for dup in (("j", 1, "dev03", "m-dev03", b"other"), ("j", 1, "dev03", "m-new", b"other")):
        with pytest.raises(StoreError, match="already stored"):
            store.add_contribution(*dup)
    assert stored_files(tmp_path / "state.db.blobs") == before


def test_a_missing_or_truncated_file_is_a_clear_error_and_rows_without_payloads_read_no_file(tmp_path, caplog):
    store = new_store(tmp_path / "state.db")
    seq = store.add_contribution("j", 1, "dev01", "m1", b"0123456789")
    path = tmp_path / "state.db.blobs" / f"{seq:012d}.msg"
    path.write_bytes(b"01234")
    with pytest.raises(StoreError, match="holds 5 bytes, its row records 10"):
        list(store.contributions("j"))
    path.unlink()
    with pytest.raises(StoreError, match="missing .*restore them together"):
        list(store.contributions("j"))
    assert [(c.device, c.payload) for c in store.contributions("j", with_payload=False)] == [("dev01", b"")]
    with caplog.at_level(logging.ERROR, logger="fedfleet.aggregator"):
        Store(tmp_path / "state.db")                                  # opens, and says what is missing
    assert "1 contribution(s) have no payload file" in caplog.text


@pytest.mark.parametrize("device, message_id", [
    ("../x", "../../y"), ("a/b", "/etc/passwd"), ("d" * 5000, "m" * 5000), ("ünï\u202ecode日本", "..\\..\\z"),
    (".", ".."), ("dev\nline", "nul\x01byte"),
])
def test_hostile_ids_never_name_a_file(tmp_path, device, message_id):
    root = tmp_path / "root"
    store = new_store(root / "state.db")
    payload = os.urandom(1000)
    seq = store.add_contribution("j", 1, device, message_id, payload)
    assert [(c.device, c.message_id, c.payload) for c in store.contributions("j")] == [(device, message_id, payload)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]           # nothing escaped beside it
    for name in stored_files(root):
        assert re.fullmatch(r"state\.db(-wal|-shm)?|state\.db\.blobs/[0-9]{12}\.msg", name), name
    assert payload_files(root / "state.db.blobs") == {f"{seq:012d}.msg": payload}


def test_forget_and_quarantine_delete_the_payload_files(tmp_path):
    store = new_store(tmp_path / "state.db")
    payloads = {d: os.urandom(50_000) for d in ("dev01", "dev02", "dev03")}
    for d, p in payloads.items():
        store.add_contribution("j", 1, d, f"m-{d}", p)
    assert store.forget_device("j", "dev02") == 1
    files = stored_files(tmp_path)
    assert holds(files, payloads["dev02"][:64]) == []                        # gone from every file on disk
    assert all(holds(files, payloads[d][:64]) for d in ("dev01", "dev03"))
    store.quarantine("j", 1, "dev01", "m-dev01", "failed to apply")
    assert holds(stored_files(tmp_path), payloads["dev01"][:64]) == []
    assert [(c.device, c.payload) for c in store.contributions("j")] == [("dev03", payloads["dev03"])]
    assert len(payload_files(tmp_path / "state.db.blobs")) == 1


CRASHING_WRITER = """
import sys, time
from aggregator.storage.store import Store
store = Store(sys.argv[1])
store.create_job("j", "fed3r", {})
store.open_round("j", 1, [], {}, {}, time.time() + 60)
store.add_contribution("j", 1, "dev01", "m1", b"first" * 1000)
store.add_contribution("j", 1, "dev02", "m2", b"second" * 1000)      # SIGKILLed before this row commits
"""


def test_a_kill_between_the_payload_file_and_its_commit_leaves_an_orphan_that_opening_deletes(tmp_path, caplog):
    state = tmp_path / "state.db"
    env = {**os.environ, "PYTHONPATH": str(REPO), "FEDFLEET_CRASH_AT": "contribution_file_written:2"}
    proc = subprocess.run([sys.executable, "-c", CRASHING_WRITER, str(state)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    # on disk at the kill: the second payload complete in its file, its row not committed
    assert sqlite3.connect(state).execute("SELECT seq, device FROM contributions").fetchall() == [(1, "dev01")]
    blobs = tmp_path / "state.db.blobs"
    assert payload_files(blobs) == {"000000000001.msg": b"first" * 1000, "000000000002.msg": b"second" * 1000}
    with caplog.at_level(logging.WARNING, logger="fedfleet.aggregator"):
        store = Store(state)
    assert "removed 1 payload file(s) of no contribution" in caplog.text
    assert payload_files(blobs) == {"000000000001.msg": b"first" * 1000}
    # the seq of the insert that never committed is given again; its new file replaces nothing stale
    assert store.add_contribution("j", 1, "dev02", "m2-retry", b"retry") == 2
    assert [(c.device, c.payload) for c in store.contributions("j")] == [("dev01", b"first" * 1000),
                                                                       ("dev02", b"retry")]


def done_within(make, seconds: float = 10):
    """``make()``'s result (or what it raised), made in a thread; None if it still waits after
    ``seconds`` (opening a FIFO waits for its other end)."""
    outcome = []

    def run():
        try:
            outcome.append(make())
        except BaseException as exc:         # what it met, whatever it was
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    return outcome[0] if outcome else None


def test_a_foreign_entry_under_the_next_payload_name_is_passed_over_never_written_through(tmp_path, caplog):
    """A review's finding: a folder holding files under the next seq's name (the sweep leaves such
    a folder alone) made every insert fail with IsADirectoryError, and SQLite gave that seq out
    again after each rollback (the job was rebuilt at every result). The row takes the next number
    instead (seqs name and order rows, nothing more), the entry's path said; a link or a FIFO put
    there while the store runs is passed over the same way, never written through nor waited on.
    A kill between such a payload's file and its commit resumes as any other."""
    state, blobs = tmp_path / "state.db", tmp_path / "state.db.blobs"
    blobs.mkdir()
    folder = blobs / f"{2:012d}.msg"                  # where the writer's second payload goes
    folder.mkdir()
    (folder / "notes.txt").write_text("someone's")
    env = {**os.environ, "PYTHONPATH": str(REPO), "FEDFLEET_CRASH_AT": "contribution_file_written:2"}
    proc = subprocess.run([sys.executable, "-c", CRASHING_WRITER, str(state)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert f"{folder} is not a regular file" in proc.stderr
    assert payload_files(blobs) == {f"{1:012d}.msg": b"first" * 1000, f"{3:012d}.msg": b"second" * 1000,
                                    f"{2:012d}.msg/notes.txt": b"someone's"}
    with caplog.at_level(logging.WARNING, logger="fedfleet.aggregator"):
        store = Store(state)
        assert store.add_contribution("j", 1, "dev02", "m2-retry", b"retry") == 3
        precious = tmp_path / "precious.txt"
        precious.write_text("an operator's file")
        store.blobs.path(4).unlink()
        store.blobs.path(4).symlink_to(precious)
        store.blobs.path(5).unlink()
        os.mkfifo(store.blobs.path(5))
        added = done_within(lambda: store.add_contribution("j", 1, "dev03", "m3", b"three"))
        if added is None:                   # waiting on the FIFO: give it a reader, then fail
            os.close(os.open(store.blobs.path(5), os.O_RDONLY | os.O_NONBLOCK))
            pytest.fail("writing a payload waited on a FIFO under its name")
    assert added == 6, added
    assert precious.read_text() == "an operator's file" and (folder / "notes.txt").read_text() == "someone's"
    passed_over = [r.getMessage() for r in caplog.records if "stored under the next number" in r.getMessage()]
    assert [str(store.blobs.path(s)) in m for m, s in zip(passed_over, (2, 4, 5))] == [True] * 3, passed_over
    expected = [("dev01", b"first" * 1000), ("dev02", b"retry"), ("dev03", b"three")]
    assert [(c.device, c.payload) for c in store.contributions("j")] == expected
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedfleet.aggregator"):
        reopened = Store(state)
    assert [(c.seq, c.device, c.payload) for c in reopened.contributions("j")] == \
        [(1, *expected[0]), (3, *expected[1]), (6, *expected[2])]
    assert "no payload file" not in caplog.text and (folder / "notes.txt").exists()
    assert reopened.add_contribution("j", 1, "dev04", "m4", b"four") == 7          # no number given twice


def test_a_hard_link_under_a_spare_payload_name_is_passed_over_and_its_file_left_whole(tmp_path, caplog):
    """A review's finding: a spare name replaced by a hard link to another file (no symbolic link, so
    O_NOFOLLOW let it through) was opened with O_TRUNC, which emptied that other file, and the payload
    was written into it. The name is passed over as a link is, and the other file keeps its bytes."""
    store = new_store(tmp_path / "state.db")
    first = store.add_contribution("j", 1, "dev01", "m1", b"first")
    precious = tmp_path / "precious.txt"
    precious.write_text("an operator's file")
    spare = store.blobs.path(first + 1)
    spare.unlink()
    os.link(precious, spare)
    with caplog.at_level(logging.WARNING, logger="fedfleet.aggregator"):
        second = store.add_contribution("j", 1, "dev02", "m2", b"second")
    assert second == first + 2
    assert precious.read_text() == "an operator's file"
    assert any("hard link" in r.getMessage() and str(spare) in r.getMessage() for r in caplog.records), caplog.text
    assert [(c.device, c.payload) for c in store.contributions("j")] == [("dev01", b"first"), ("dev02", b"second")]
    later_spare = store.blobs.path(second + 1)          # above the mark: opening empties such a name...
    later_spare.unlink()
    os.link(precious, later_spare)
    reopened = Store(tmp_path / "state.db")             # ...but a hard link's name goes, its file stays
    assert precious.read_text() == "an operator's file" and not later_spare.exists()
    assert [(c.device, c.payload) for c in reopened.contributions("j")] == [("dev01", b"first"), ("dev02", b"second")]


def test_a_name_a_committed_delete_cannot_remove_is_logged_and_the_delete_stands(tmp_path, caplog):
    """A review's finding: a folder under a deleted row's name raised IsADirectoryError after the
    delete committed, so ``device forget`` reported a failure although the forget had committed.
    Removing the files is cleanup: a name that cannot go is logged, the others still go."""
    store = new_store(tmp_path / "state.db")
    store.open_round("j", 2, [], {}, {}, time.time() + 60)
    first = store.add_contribution("j", 1, "dev02", "m1", b"one")
    second = store.add_contribution("j", 2, "dev02", "m2", b"two")
    kept = store.add_contribution("j", 2, "dev03", "m3", b"three")
    store.blobs.path(first).unlink()
    store.blobs.path(first).mkdir()
    (store.blobs.path(first) / "notes.txt").write_text("someone's")
    with caplog.at_level(logging.WARNING, logger="fedfleet.aggregator"):
        assert store.forget_device("j", "dev02") == 2
    assert f"{store.blobs.path(first)} of a deleted contribution not removed" in caplog.text
    assert not store.blobs.path(second).exists() and store.blobs.path(kept).read_bytes() == b"three"
    assert store.forgotten("j") == ["dev02"] and [c.device for c in store.contributions("j")] == ["dev03"]


def test_opening_waits_for_a_writer_between_its_file_and_its_commit(tmp_path):
    """The orphan sweep of a second opener runs under the write lock, never between another writer's
    file and its commit (which would leave a committed row without its file)."""
    writer = new_store(tmp_path / "state.db")
    db = writer.db
    db.execute("BEGIN IMMEDIATE")                          # what add_contribution does, held open here
    seq = db.execute("INSERT INTO contributions (job_id, round, device, message_id, payload_bytes, received_at) "
                     "VALUES ('j', 1, 'dev01', 'm1', 4, 0)").lastrowid
    writer.blobs.write(seq, b"data")
    opened = []
    opener = threading.Thread(target=lambda: opened.append(Store(tmp_path / "state.db")))
    opener.start()
    opener.join(0.5)
    assert opener.is_alive() and writer.blobs.path(seq).exists()    # blocked on the lock, file untouched
    db.execute("COMMIT")
    opener.join(30)
    assert [c.payload for c in opened[0].contributions("j")] == [b"data"]


def test_a_batch_whose_file_fails_commits_nothing_and_its_seqs_are_given_again(tmp_path):
    store = Store(tmp_path / "state.db")
    store.create_job("j", "fed3r", {})
    write = store.blobs.write

    def full_disk(seq, data):            # the second payload's file fails, as a full disk would
        if data == b"two":
            raise OSError(28, "No space left on device (injected)")
        write(seq, data)

    store.blobs.write = full_disk
    with pytest.raises(OSError, match="injected"):
        store.add_contributions([("j", 1, "dev01", "m1", b"one"), ("j", 1, "dev02", "m2", b"two"),
                                 ("j", 1, "dev03", "m3", b"three")])
    assert list(store.contributions("j")) == []            # all or none: dev01's row is gone too
    assert store.add_contributions([("j", 1, "dev01", "m1", b"again")]) == [1]
    assert [(c.device, c.payload) for c in store.contributions("j")] == [("dev01", b"again")]


V1_CONTRIBUTIONS = """CREATE TABLE IF NOT EXISTS contributions (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id      TEXT NOT NULL,
    round       INTEGER NOT NULL,
    device      TEXT NOT NULL,
    message_id  TEXT NOT NULL,
    payload     BLOB NOT NULL,
    received_at REAL NOT NULL,
    UNIQUE (job_id, message_id),
    UNIQUE (job_id, round, device)
)"""


def make_v1_store(path, payloads: dict[str, bytes]) -> None:
    """A store as schema version 1 wrote it: the payloads inside the contributions table."""
    v1_schema = SCHEMA.replace(CONTRIBUTIONS.format(name="contributions"), V1_CONTRIBUTIONS)
    assert v1_schema != SCHEMA
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(f"BEGIN; {v1_schema} INSERT INTO meta VALUES ('schema_version', '1'); COMMIT;")
    for i, (device, payload) in enumerate(payloads.items()):
        db.execute("INSERT INTO contributions (job_id, round, device, message_id, payload, received_at) "
                   "VALUES ('j', 1, ?, ?, ?, ?)", (device, f"m{i}", payload, time.time()))
    db.execute("DELETE FROM contributions WHERE device='gone'")      # a forgotten row: its seq is never reused
    db.close()


def test_a_version_1_store_is_migrated_to_payload_files(tmp_path, caplog):
    payloads = {"dev01": os.urandom(200_000), "dev02": b"small", "gone": os.urandom(1000)}
    make_v1_store(tmp_path / "state.db", payloads)
    v1_size = (tmp_path / "state.db").stat().st_size
    with caplog.at_level(logging.WARNING, logger="fedfleet.aggregator"):
        store = Store(tmp_path / "state.db")
    assert "migrated from schema version 1" in caplog.text
    assert [(c.seq, c.device, c.payload) for c in store.contributions("j")] == [
        (1, "dev01", payloads["dev01"]), (2, "dev02", b"small")]
    assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    assert "payload" not in {r[1] for r in store.db.execute("PRAGMA table_info(contributions)")}
    assert store.add_contribution("j", 1, "dev03", "m9", b"new") == 4         # after the forgotten seq 3
    store.close()
    files = stored_files(tmp_path)
    assert holds(files, payloads["dev01"][:64]) == ["state.db.blobs/000000000001.msg"]   # the DB let go of it
    assert (tmp_path / "state.db").stat().st_size < v1_size - 150_000          # ...and of its pages (VACUUM)
    assert sorted(payload_files(tmp_path / "state.db.blobs")) == [
        "000000000001.msg", "000000000002.msg", "000000000004.msg"]
    assert [c.payload for c in Store(tmp_path / "state.db").contributions("j")][-1] == b"new"


def test_a_store_of_an_unknown_schema_version_is_refused(tmp_path):
    Store(tmp_path / "state.db").close()
    sqlite3.connect(tmp_path / "state.db", isolation_level=None).execute(
        "UPDATE meta SET value='99' WHERE key='schema_version'")
    with pytest.raises(StoreError, match=f"schema version 99, this aggregator uses {SCHEMA_VERSION}"):
        Store(tmp_path / "state.db")


def test_names_are_made_ahead_and_bytes_of_no_row_are_removed_at_open(tmp_path, caplog):
    store = new_store(tmp_path / "state.db")
    blobs = tmp_path / "state.db.blobs"
    first = store.add_contribution("j", 1, "dev01", "m1", b"one")
    assert sorted(p.name for p in blobs.iterdir()) == [f"{s:012d}.msg" for s in range(first, first + 64)]
    second = store.add_contribution("j", 1, "dev02", "m2", b"two")       # into a spare: no new name
    assert len(list(blobs.iterdir())) == 64 and store.blobs.path(second).read_bytes() == b"two"
    # a delete committed, then a crash before its file went: the seq is never given again, the file goes
    sqlite3.connect(tmp_path / "state.db", isolation_level=None).execute("DELETE FROM contributions WHERE seq=?",
                                                                         (second,))
    (blobs / "notes.txt").write_text("an operator's file")
    with caplog.at_level(logging.WARNING, logger="fedfleet.aggregator"):
        reopened = Store(tmp_path / "state.db")
    assert "removed 1 payload file(s) of no contribution" in caplog.text
    assert not store.blobs.path(second).exists() and (blobs / "notes.txt").exists()
    assert payload_files(blobs) == {f"{first:012d}.msg": b"one", "notes.txt": b"an operator's file"}
    assert reopened.add_contribution("j", 1, "dev03", "m3", b"three") == second + 1


def large_sizes():
    from aggregator.storage.blob_files import BlobFiles
    direct, bounce = BlobFiles.DIRECT_FROM, BlobFiles.BOUNCE
    return [direct - 1, direct, direct + 4097, bounce - 1, bounce, bounce + 1, 2 * bounce + 4097]


@pytest.mark.parametrize("direct", [True, False])
def test_large_payloads_read_back_exactly_around_or_through_the_page_cache(tmp_path, direct):
    """Large payloads are written with O_DIRECT through an aligned buffer, the last block padded
    and the file cut back: every size around the block and buffer boundaries reads back exactly,
    as it does buffered."""
    from aggregator.storage.blob_files import BlobFiles
    files = BlobFiles(tmp_path / "blobs", durable=True)
    files.direct = direct and files.direct
    for seq, size in enumerate(large_sizes(), start=1):
        data = os.urandom(size)
        files.write(seq, data)
        assert files.path(seq).stat().st_size == size and files.read(seq, size) == data
    assert files.direct == (direct and hasattr(os, "O_DIRECT"))   # this file system takes O_DIRECT


def test_a_file_system_that_refuses_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    """No file system here refuses O_DIRECT, so the refusal (EINVAL from fcntl) is injected."""
    import errno
    import fcntl

    from aggregator.storage.blob_files import BlobFiles
    real = fcntl.fcntl

    def refusing(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refusing)
    files = BlobFiles(tmp_path / "blobs", durable=True)
    data = os.urandom(BlobFiles.BOUNCE + 1)
    files.write(1, data)
    assert files.read(1, len(data)) == data and not files.direct


def test_a_direct_write_that_fails_leaves_the_file_empty(tmp_path, monkeypatch):
    from aggregator.storage.blob_files import BlobFiles
    files = BlobFiles(tmp_path / "blobs", durable=True)
    files.write(1, os.urandom(BlobFiles.BOUNCE * 2))        # what a failed rewrite of the name must not keep
    writes = []
    real = os.write

    def full_disk(fd, data):
        writes.append(len(data))
        if len(writes) == 2:                                # the second block of a direct write
            raise OSError(28, "No space left on device (injected)")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match="injected"):
        files.write(1, os.urandom(BlobFiles.BOUNCE * 2))
    assert files.path(1).stat().st_size == 0 and files.direct


def test_opening_never_follows_a_link_in_the_blob_folder_nor_stops_at_a_name_that_is_no_file(tmp_path, caplog):
    """A review's findings in the sweep at open: a spare's name (above the AUTOINCREMENT mark)
    replaced by a symbolic link had its *target* truncated to 0 bytes (os.truncate follows links:
    an operator's file, the DB itself); a dangling link, or a folder under a name of no row, made the
    store unopenable (FileNotFoundError, IsADirectoryError). Links and other nodes of no row go (never
    their target), an empty folder too, one holding files is left alone; the store opens and writes."""
    store = new_store(tmp_path / "state.db")
    seq = store.add_contribution("j", 1, "dev01", "m1", b"one")
    store.close()
    blobs = tmp_path / "state.db.blobs"
    precious = tmp_path / "precious.txt"
    precious.write_text("an operator's file")
    for spare, target in ((seq + 1, precious), (seq + 2, tmp_path / "state.db")):
        store.blobs.path(spare).unlink()
        store.blobs.path(spare).symlink_to(target)
    db_bytes = (tmp_path / "state.db").read_bytes()
    Store(tmp_path / "state.db").close()
    assert precious.read_text() == "an operator's file" and (tmp_path / "state.db").read_bytes() == db_bytes
    store.blobs.path(seq + 3).unlink()
    store.blobs.path(seq + 3).symlink_to(tmp_path / "nowhere")
    store.blobs.path(seq + 4).unlink()
    os.mkfifo(store.blobs.path(seq + 4))
    store.blobs.path(seq + 5).unlink()
    store.blobs.path(seq + 5).mkdir()
    (store.blobs.path(seq + 5) / "notes.txt").write_text("someone's")     # a folder with files: left alone
    (blobs / f"{0:012d}.msg").mkdir()                      # an empty one, at or below the mark, of no row: goes
    with caplog.at_level(logging.WARNING, logger="fedfleet.aggregator"):
        reopened = Store(tmp_path / "state.db")
    assert not any(store.blobs.path(s).is_symlink() or store.blobs.path(s).exists() for s in range(seq + 1, seq + 5))
    assert (store.blobs.path(seq + 5) / "notes.txt").read_text() == "someone's"
    assert not (blobs / f"{0:012d}.msg").exists()
    assert [c.payload for c in reopened.contributions("j")] == [b"one"]
    assert reopened.add_contribution("j", 1, "dev02", "m2", b"two") == seq + 1     # the name made again, a file
    assert store.blobs.path(seq + 1).read_bytes() == b"two" and not store.blobs.path(seq + 1).is_symlink()
    assert "contribution(s) have no payload file" not in caplog.text


def test_a_payload_name_that_is_no_regular_file_is_a_clear_error_and_never_blocks(tmp_path, caplog):
    """A review's findings in reading a payload: its name replaced by a FIFO blocked the reader (the
    restore, a forget's re-solve) for ever; by a folder it was an IsADirectoryError, not the store's
    error; a link was followed (to /dev/zero: read until memory ran out). Each is the StoreError of a
    missing payload, said at once, and reported at open as a contribution without its file."""
    store = new_store(tmp_path / "state.db")
    seq = store.add_contribution("j", 1, "dev01", "m1", b"0123456789")
    path = store.blobs.path(seq)
    elsewhere = tmp_path / "elsewhere.msg"
    elsewhere.write_bytes(b"0123456789")

    def fifo():
        os.mkfifo(path)

    for name, make in (("fifo", fifo), ("folder", path.mkdir), ("link", lambda: path.symlink_to(elsewhere)),
                       ("link to a device", lambda: path.symlink_to("/dev/zero"))):
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()     # the last case's node
        make()
        outcome = []

        def read():
            try:
                outcome.append(list(store.contributions("j")))
            except BaseException as exc:         # what the reader met, whatever it was
                outcome.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(10)
        if reader.is_alive():                   # blocked opening the FIFO: let it go, then fail
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(10)
            pytest.fail(f"{name}: reading the payload blocked")
        assert isinstance(outcome[0], StoreError) and "not a regular file" in str(outcome[0]) \
            and "restore them together" in str(outcome[0]), (name, outcome)
        with caplog.at_level(logging.ERROR, logger="fedfleet.aggregator"):
            Store(tmp_path / "state.db").close()
        assert "1 contribution(s) have no payload file" in caplog.text, name
        caplog.clear()
