"""What every repository of the store shares: the SQLite file, one connection per thread, the
write transaction, the payload files beside it and the crash points.

Every public write method is one :meth:`StoreConnection._tx`: ``BEGIN IMMEDIATE`` takes SQLite's
write lock at the start (so two writers, of this process or another, never interleave a read and
a write of one transaction), a clean exit commits, an exception rolls back and propagates. At
``synchronous=FULL`` in WAL mode a commit is durable before it returns, so a caller that commits
and *then* acknowledges never acknowledges something it could lose. The writer is the
aggregator's service thread; readers (the admin API thread) get their own connection per thread
(WAL lets them read while it writes).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from aggregator.service.crash_points import CrashPoints
from aggregator.storage.blob_files import BlobFiles

SYNCHRONOUS_MODES = ("FULL", "NORMAL", "OFF")


class StoreError(RuntimeError):
    """The store refuses an operation (unknown job, config mismatch, bad state transition)."""


def existing_tables(path: Path) -> tuple[set[str], str | None] | None:
    """The table names and the ``meta`` schema version of the database file at ``path``, read without
    changing it (no journal mode, no table, no blob folder: what opening a store does comes after);
    None where there is no file yet, or an empty one (SQLite's new database). StoreError when it is
    not an SQLite database at all (a folder, another program's file, a damaged header)."""
    if not path.exists():
        return None
    if path.is_file() and path.stat().st_size == 0:
        return None
    if not path.is_file():
        raise StoreError(f"{path} is not a state database: it is not a regular file")
    try:
        conn = sqlite3.connect(path, timeout=30, isolation_level=None)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            try:
                row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() \
                    if "meta" in tables else None
            except sqlite3.OperationalError as exc:         # a table named meta, not ours
                raise StoreError(f"{path} is not a fedfleet state database: its meta table is another's ({exc})") \
                    from None
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise StoreError(f"{path} cannot be opened as a state database: {exc}") from None     # locked, too
    return tables, None if row is None else str(row[0])


class StoreConnection:
    """The base of every repository: ``db`` (this thread's connection), ``_tx()`` (one write
    transaction), ``blobs`` (the contribution payload files), ``_crash`` (the crash points)."""

    def __init__(self, path: str | Path, synchronous: str = "FULL"):
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError("synchronous must be FULL, NORMAL or OFF")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.synchronous = synchronous
        self._local = threading.local()
        self.commit_seconds = 0.0      # time spent in write transactions, payload files included
        self.commits = 0
        self.blobs = BlobFiles(self.path.with_name(self.path.name + ".blobs"), durable=synchronous != "OFF")
        self._crash = CrashPoints.from_env()

    @property
    def db(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            # a new file only (an existing one keeps its page size): contributions are megabytes, and
            # 32 KiB pages write one in a quarter of the WAL frames of 4 KiB ones (about half the time)
            conn.execute("PRAGMA page_size=32768")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={self.synchronous}")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.row_factory = sqlite3.Row
            self._local.conn = conn
        return conn

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _create_tables(self, schema: str) -> None:
        """``schema`` (``CREATE ... IF NOT EXISTS`` statements) in one write transaction; a script, so
        not inside :meth:`_tx` (``executescript`` would commit that transaction first)."""
        self.db.executescript(f"BEGIN IMMEDIATE; {schema} COMMIT;")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction on this thread's connection, counted in ``commits`` and timed in
        ``commit_seconds`` (rolled back ones too: they held the lock as long)."""
        t0 = time.perf_counter()
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        else:
            db.execute("COMMIT")
        finally:
            self.commit_seconds += time.perf_counter() - t0
            self.commits += 1
