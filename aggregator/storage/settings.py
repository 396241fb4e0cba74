"""Operator settings that outlive a process (``settings``: the fleet mode, each job's round-log
path, the devices a job's fleet screen spares, when a stopped job was started again), as text under a key."""

from __future__ import annotations

import sqlite3

from aggregator.storage.connection import StoreConnection


def read_setting(db: sqlite3.Connection, key: str) -> str | None:
    """``key``'s value on ``db`` (inside a caller's transaction too)."""
    row = db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
    return row[0] if row else None


def write_setting(db: sqlite3.Connection, key: str, value: str) -> None:
    db.execute("INSERT OR REPLACE INTO settings VALUES (?, ?)", (key, value))


class SettingRepository(StoreConnection):
    def setting(self, key: str) -> str | None:
        return read_setting(self.db, key)

    def set_setting(self, key: str, value: str) -> None:
        with self._tx() as db:
            write_setting(db, key, value)
