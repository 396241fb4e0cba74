"""What ``aggregator serve --state FILE`` must refuse before it writes anything (a review's findings):
a database of another program was taken for a new store (switched to WAL, given fedfleet's tables
and a blob folder, then served), a store of a newer schema was given this version's tables and
switched to WAL before its refusal (a StoreError traceback), a version that is no number was
``invalid literal for int()``, and a file that is no database, or a folder, was an SQLite
traceback after its blob folder had been made. Each is one StoreError naming the file, the file's
bytes and its folder as they were; ``serve`` says it in one line (exit 2). Real SQLite, real files,
a real broker for the command."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from aggregator.storage.schema import SCHEMA, SCHEMA_VERSION
from aggregator.storage.store import Store, StoreError


def foreign_database(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE recipes (name TEXT, steps TEXT)")
    db.execute("INSERT INTO recipes VALUES ('bread', 'knead')")
    db.commit()
    db.close()


def store_of_version(version: str):
    def make(path: Path) -> None:
        Store(path).close()
        db = sqlite3.connect(path)
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (version,))
        db.execute("DROP TABLE deployment_counters")        # a table this version would create again
        db.commit()
        db.close()
    return make


def another_programs_meta(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE meta (name TEXT)")
    db.commit()
    db.close()


REFUSED = {
    "another program's database": (foreign_database, "is not a fedfleet state database: it holds tables recipes"),
    "a newer schema": (store_of_version(str(SCHEMA_VERSION + 1)),
                       f"schema version {SCHEMA_VERSION + 1}, this aggregator uses {SCHEMA_VERSION} "
                       "(and migrates 1, 2, 3 and 4): a newer aggregator wrote it"),
    "a version that is no number": (store_of_version("x"), f"schema version x, this aggregator uses {SCHEMA_VERSION}"),
    "no database": (lambda p: p.write_bytes(b"these are not the bytes of an SQLite file\n" * 100),
                    "cannot be opened as a state database: file is not a database"),
    "a folder": (lambda p: p.mkdir(), "is not a state database: it is not a regular file"),
    "a meta table of another program": (another_programs_meta, "its meta table is another's"),
}


def folder_as_it_is(folder: Path) -> dict[str, bytes | None]:
    return {p.name: p.read_bytes() if p.is_file() else None for p in folder.iterdir()}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_file_that_is_no_store_of_this_version_is_refused_unchanged(tmp_path, case):
    make, words = REFUSED[case]
    make(tmp_path / "state.db")
    before = folder_as_it_is(tmp_path)
    with pytest.raises(StoreError) as refused:
        Store(tmp_path / "state.db")
    assert words in str(refused.value) and str(tmp_path / "state.db") in str(refused.value)
    assert folder_as_it_is(tmp_path) == before, "the refused file (or its folder) was changed"


def test_what_a_store_may_be_still_opens(tmp_path):
    """No file, an empty file, and fedfleet's tables without their version yet (a first open cut
    short between its tables and its version) open as a new store; a version 2 store opens."""
    Store(tmp_path / "new.db").close()
    (tmp_path / "empty.db").touch()
    Store(tmp_path / "empty.db").close()
    sqlite3.connect(tmp_path / "cut.db", isolation_level=None).executescript(f"BEGIN; {SCHEMA} COMMIT;")
    Store(tmp_path / "cut.db").close()
    store_of_version("2")(tmp_path / "v2.db")
    for name in ("new.db", "empty.db", "cut.db", "v2.db"):
        store = Store(tmp_path / name)
        assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
        store.close()


def test_serve_refuses_another_programs_database_in_one_line(broker, tmp_path, capsys):
    from aggregator.cli import main as aggregator_main

    foreign_database(tmp_path / "recipes.db")
    before = folder_as_it_is(tmp_path)
    rc = aggregator_main(["serve", "--out", str(tmp_path / "o"), "--broker", broker.url, "--timeout", "5",
                          "--state", str(tmp_path / "recipes.db")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "WARNING" not in line]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"fedfleet aggregator: error: --state {tmp_path / 'recipes.db'}: ") \
        and "not a fedfleet state database" in lines[0], err
    assert {k: v for k, v in folder_as_it_is(tmp_path).items() if k != "o"} == before


def stored_job(state: Path, config: dict) -> int:
    """A store holding ``config``'s fed3r job with round 1 open and one result of it stored; its seq."""
    from aggregator.jobs.registry import build_job
    from protocols.envelope import Envelope, encode

    job = build_job("fed3r", config)
    store = Store(state)
    store.create_job(config["job_id"], "fed3r", job.config.to_dict(), state="running")
    assert job.next_participants({"dev01"}) == ["dev01"]
    store.open_round(config["job_id"], 1, ["dev01"], {"dev01": "task-1"}, job.bookkeeping(), 4e9)
    seq = store.add_contribution(config["job_id"], 1, "dev01", "m1", encode(Envelope("result", "dev01", {"x": 1})))
    store.close()
    return seq


def database_dump(state: Path) -> list[str]:
    """The store's rows, less its settings (a start records the fleet mode it found none of)."""
    db = sqlite3.connect(state)
    try:
        return [line for line in db.iterdump() if not line.startswith('INSERT INTO "settings"')]
    finally:
        db.close()


def damage_checkpoint(state: Path, seq: int) -> None:
    db = sqlite3.connect(state)
    db.execute("INSERT INTO checkpoints VALUES ('j1', 0, x'00ff', '{}', 0)")
    db.commit()
    db.close()


def replace_payload(state: Path, seq: int) -> None:
    path = state.with_name(state.name + ".blobs") / f"{seq:012d}.msg"
    path.write_bytes(bytes(len(path.read_bytes())))         # its length kept, its bytes zeros (no envelope)


RESTORE_REFUSED = {
    "another config": (None, {"num_classes": 12}, "job 'j1' is stored with a different kind/config"),
    "a damaged checkpoint": (damage_checkpoint, {}, "job 'j1''s checkpoint cannot be restored"),
    "a payload that is no envelope": (replace_payload, {}, "contribution 1 of job 'j1' (dev01, round 1) cannot be "
                                                           "restored"),
}


@pytest.mark.parametrize("case", sorted(RESTORE_REFUSED))
def test_serve_config_refuses_a_stored_job_it_cannot_restore_in_one_line(broker, tmp_path, capsys, case):
    """A review's finding: ``serve --config job.json --state FILE`` (how a crashed job is restarted)
    on a store whose job it cannot take back — stored under another config, a checkpoint or a
    stored result that does not read back — was a StoreError (or a bare envelope error) traceback at
    every restart. One line naming --state and the row, exit 2, the job's rows as they were."""
    import json

    from aggregator.cli import main as aggregator_main

    damage, change, words = RESTORE_REFUSED[case]
    config = {"num_classes": 10, "job_id": "j1", "clients_per_round": 1}
    seq = stored_job(tmp_path / "state.db", config)
    if damage is not None:
        damage(tmp_path / "state.db", seq)
    before = database_dump(tmp_path / "state.db")
    (tmp_path / "job.json").write_text(json.dumps({**config, **change}))
    rc = aggregator_main(["serve", "--out", str(tmp_path / "o"), "--config", str(tmp_path / "job.json"),
                          "--broker", broker.url, "--timeout", "5", "--state", str(tmp_path / "state.db")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "WARNING" not in line]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"fedfleet aggregator: error: --state {tmp_path / 'state.db'}: ") \
        and words in lines[0], err
    assert database_dump(tmp_path / "state.db") == before
