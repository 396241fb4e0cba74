"""Durable aggregator state in one SQLite file (WAL) and, beside it, a directory of contribution
payload files (``<db path>.blobs/``, :mod:`aggregator.storage.blob_files`): a thin adapter, no protocol logic.

:class:`Store` is the one object callers hold; it is the composition of one repository per
aggregate, all on the same connection and transaction discipline
(:mod:`aggregator.storage.connection`). What is stored, where, and why that is enough to resume a
job bit for bit after a crash:

* ``devices``, ``clusters``             :mod:`aggregator.storage.devices`: enrolment (Ed25519
                                        public key, MQTT password hash, revoked or not), presence,
                                        profile, cluster; ``fleet_changes`` (by triggers): the
                                        last change to each device's place in the fleet.
* ``jobs``                              :mod:`aggregator.storage.jobs`: kind, config, state.
* ``rounds``, ``round_events``,         :mod:`aggregator.storage.rounds`: each opened round with
  ``checkpoints``                       the job's bookkeeping (its secrets sealed under
                                        :attr:`Store.sealing_key`, kept outside this file:
                                        :mod:`aggregator.service.sealed_draws`), its declines and
                                        rejections, and the job's exact state as of its last
                                        closed round.
* ``contributions``                     :mod:`aggregator.storage.contributions`: every accepted
                                        result, durable (row and payload file) before its ack.
* ``quarantine``, ``forgotten``         :mod:`aggregator.storage.exclusions`: contributions taken
                                        out of the replay (failed to apply, screened, forgotten).
* ``models``                            :mod:`aggregator.storage.models`: versions and lineage.
* ``evaluations``                       :mod:`aggregator.storage.evaluations`: accuracy curves.
* ``settings``                          :mod:`aggregator.storage.settings`: the fleet mode, ...
* ``deployments``                       :mod:`aggregator.storage.deployments` (its own object on
                                        this store's connection).

Opening a store creates the tables (:mod:`aggregator.storage.schema`), migrates an older schema
and removes the payload files of no row (a crash between a delete's commit and its files'
removal); it does so holding the write lock, so it never races a writer of another process
between its file and its commit. The payloads are written once and read back as stored; no
checksum is kept beside them (the row's length catches a torn or truncated file; a result's own
payload sha256 is inside its envelope for a reader that wants to re-verify it).
"""

from __future__ import annotations

import logging
import re
import sqlite3
from pathlib import Path

from aggregator.security.sealing_key import SealingKey
from aggregator.storage.connection import StoreError, existing_tables
from aggregator.storage.contributions import ContributionRepository, StoredContribution
from aggregator.storage.devices import DeviceRepository
from aggregator.storage.evaluations import EvaluationRepository
from aggregator.storage.exclusions import SCREEN_EXEMPT_PREFIX, ExclusionRepository
from aggregator.storage.jobs import JobRepository
from aggregator.storage.models import ModelRepository, arrays_sha256, npz_bytes
from aggregator.storage.rounds import RoundRepository, StoredRound
from aggregator.storage.schema import (ADDED_COLUMNS, FINAL_JOB_STATES, JOB_STATES, MIGRATE_FROM_V1, SCHEMA,
                                      SCHEMA_VERSION, JobState)
from aggregator.storage.settings import SettingRepository

# the names callers imported from this module before the split keep working
__all__ = ["Store", "StoreError", "StoredRound", "StoredContribution", "JobState", "JOB_STATES", "FINAL_JOB_STATES",
           "SCREEN_EXEMPT_PREFIX", "arrays_sha256", "npz_bytes"]

log = logging.getLogger("fedfleet.aggregator")

# the tables of every version this aggregator opens (sqlite_sequence: SQLite's AUTOINCREMENT marks)
STORE_TABLES = frozenset(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA)) | {"sqlite_sequence"}
READABLE_VERSIONS = ("1", "2", "3", "4", str(SCHEMA_VERSION))
MIGRATED_VERSIONS = f"{', '.join(READABLE_VERSIONS[:-2])} and {READABLE_VERSIONS[-2]}"     # what the messages say


def checked_state_file(path: Path) -> None:
    """Refuse, before anything is written, a file this aggregator must not open as its store: one
    of a schema version it does not know (a newer aggregator's, which creating this version's
    tables and switching it to WAL would have changed before the refusal), a database of another
    program (it was taken for a new store and given fedfleet's tables), or no database at all.
    A database holding fedfleet tables and no version yet is a first open cut short between its
    tables and its version: opened."""
    found = existing_tables(path)
    if found is None:
        return
    tables, version = found
    if version is None and tables - STORE_TABLES:
        raise StoreError(f"{path} is not a fedfleet state database: it holds tables "
                         f"{', '.join(sorted(tables - STORE_TABLES)[:5])} and no fedfleet schema version "
                         f"(check --state)")
    if version is not None and version not in READABLE_VERSIONS:
        newer = version.isdigit() and int(version) > SCHEMA_VERSION
        why = "a newer aggregator wrote it: run that version" if newer else "no aggregator writes that version"
        raise StoreError(f"{path} has schema version {version[:40]}, this aggregator uses {SCHEMA_VERSION} "
                         f"(and migrates {MIGRATED_VERSIONS}): {why}")


class Store(DeviceRepository, JobRepository, RoundRepository, ContributionRepository, ExclusionRepository,
            ModelRepository, EvaluationRepository, SettingRepository):
    """Every repository's methods on one object, one connection per thread, one file: a store
    opens as it did before the split (same tables, same migrations)."""

    def __init__(self, path: str | Path, synchronous: str = "FULL", key_dir: str | Path | None = None):
        """``key_dir``: the folder of the key this store's secrets are sealed under (default
        ``<db path>.keys/``; ``aggregator serve`` names its secrets' folder)."""
        checked_state_file(Path(path))      # before anything is created or changed
        super().__init__(path, synchronous)
        self.sealing_key = SealingKey.of_store(self.path, key_dir)
        self._create_tables(SCHEMA)
        migrated = False
        with self._tx() as db:
            _add_columns(db)        # a store of an earlier version, or a first open of one cut short
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif migrated := row[0] == "1":
                self._migrate_from_v1(db)
            elif row[0] in ("2", "3", "4"):     # the tables and columns they lack, made above, are all 3-5 add
                db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
            elif row[0] != str(SCHEMA_VERSION):      # checked_state_file's refusal, met by a writer since
                raise StoreError(f"{self.path} has schema version {row[0]}, this aggregator uses {SCHEMA_VERSION}")
            # under the write lock: no writer (of any process) is between a payload file and its commit
            high = db.execute("SELECT seq FROM sqlite_sequence WHERE name='contributions'").fetchone()
            dropped, missing = self.blobs.sweep({r[0] for r in db.execute("SELECT seq FROM contributions")},
                                                high[0] if high else 0)
        if dropped:
            log.warning("store %s: removed %d payload file(s) of no contribution (a crash before their "
                        "commit, or after their deletion)", self.path, dropped)
        if missing:
            log.error("store %s: %d contribution(s) have no payload file in %s (seq %s...): restore the "
                      "DB file and its blob directory together", self.path, len(missing), self.blobs.directory,
                      missing[:5])
        if migrated:
            self.db.execute("VACUUM")             # the v1 payloads' pages: returned to the file system

    def _migrate_from_v1(self, db: sqlite3.Connection) -> None:
        """Version 1 kept payloads in the table: each goes to its file (durable before this commit),
        then the table is rebuilt without them, keeping seqs and the AUTOINCREMENT high-water mark
        (a seq is never given twice, so a new row never meets the file of a deleted one)."""
        for seq, payload in db.execute("SELECT seq, payload FROM contributions"):
            self.blobs.write(seq, payload)
        high = db.execute("SELECT seq FROM sqlite_sequence WHERE name='contributions'").fetchone()
        for statement in MIGRATE_FROM_V1:
            db.execute(statement)
        if high is not None:
            db.execute("DELETE FROM sqlite_sequence WHERE name='contributions'")
            db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('contributions', ?)", (high[0],))
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
        log.warning("store %s: migrated from schema version 1 (contribution payloads moved to %s)",
                    self.path, self.blobs.directory)


def _add_columns(db: sqlite3.Connection) -> None:
    """The columns of ``ADDED_COLUMNS`` a table lacks (``CREATE TABLE IF NOT EXISTS`` keeps an older table as it is)."""
    for table, column, declaration, fill in ADDED_COLUMNS:
        if column not in {r[1] for r in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
            if fill:
                db.execute(fill)
