"""Contributions taken out of a job's replay after they were accepted, each in one transaction
that also drops the checkpoints still holding them in their sums and counts the device as
rejected in its rounds (a restored round does not wait for it, or take it back):

* ``quarantine``  contributions that failed to apply (e.g. statistics whose solve fails) or that
                  a fleet screen named, with the reason; an operator may release the device, which
                  the job's fleet screen then spares (a setting, ``screen_exempt:<job>``).
* ``forgotten``   devices whose contributions to a job were deleted for good (unlearning): never
                  asked again.

Their payload files are removed once the delete has committed: a crash in between leaves files
of no row, which the next open of the store removes."""

from __future__ import annotations

import json
import sqlite3
import time

from aggregator.storage.connection import StoreConnection
from aggregator.storage.settings import read_setting, write_setting

SCREEN_EXEMPT_PREFIX = "screen_exempt:"     # settings key: the devices a job's fleet screen spares


def _mark_rejected(db: sqlite3.Connection, job_id: str, round_: int, device: str, reason: str, at: float) -> None:
    db.execute("INSERT OR REPLACE INTO round_events VALUES (?, ?, ?, 'rejected', ?, ?)",
               (job_id, round_, device, reason, at))


class ExclusionRepository(StoreConnection):
    def quarantine(self, job_id: str, round_: int, device: str, message_id: str, reason: str) -> None:
        """Move an accepted contribution that failed to apply (or that a fleet screen named) out of the replay, in one transaction;
        the device counts as rejected in its round (a restored round does not wait for it)."""
        now = time.time()
        with self._tx() as db:
            deleted = db.execute("DELETE FROM contributions WHERE job_id=? AND message_id=? RETURNING seq",
                                 (job_id, message_id)).fetchall()
            db.execute("INSERT OR IGNORE INTO quarantine VALUES (?, ?, ?, ?, ?, ?)",
                       (job_id, round_, device, message_id, reason[:1000], now))
            # a checkpoint of a round at or after it holds it in its sums (a fleet screen quarantines
            # a contribution of an earlier round): the replay starts from nothing instead
            db.execute("DELETE FROM checkpoints WHERE job_id=? AND round>=?", (job_id, round_))
            _mark_rejected(db, job_id, round_, device, f"quarantined: {reason[:900]}", now)
        self.blobs.remove(r[0] for r in deleted)          # after the commit: a crash between leaves an orphan

    def release_quarantine(self, job_id: str, device: str) -> int:
        """An operator's reversal: ``device`` leaves the job's quarantine (it may be asked again; its
        quarantined bytes are gone, so it sends again) and is exempt from the job's fleet screen from
        now on. Returns how many quarantined contributions it had (0: nothing to release)."""
        with self._tx() as db:
            released = db.execute("DELETE FROM quarantine WHERE job_id=? AND device=? RETURNING device",
                                  (job_id, device)).fetchall()
            if released:
                key = SCREEN_EXEMPT_PREFIX + job_id
                exempt = sorted(set(json.loads(read_setting(db, key) or "[]")) | {device})
                write_setting(db, key, json.dumps(exempt))
        return len(released)

    def screen_exempt(self, job_id: str) -> set[str]:
        """Devices an operator released from the job's quarantine: its fleet screen spares them."""
        return set(json.loads(read_setting(self.db, SCREEN_EXEMPT_PREFIX + job_id) or "[]"))

    def quarantined(self, job_id: str) -> list[dict]:
        return [dict(r) for r in self.db.execute(
            "SELECT round, device, message_id, reason, at FROM quarantine WHERE job_id=? ORDER BY at", (job_id,))]

    def forget_device(self, job_id: str, device: str) -> int:
        """Delete a device's contributions to a job for good, in one transaction: the rows go, the
        job's checkpoint (a sum that still holds them) goes, the device is recorded as forgotten (never
        asked again) and counts as rejected in its rounds (a restored open round does not take it
        back). Their payload files are deleted once that transaction committed (a crash in between
        leaves files of no row, which the next open deletes). Returns how many contributions were deleted."""
        now = time.time()
        with self._tx() as db:
            deleted = db.execute("DELETE FROM contributions WHERE job_id=? AND device=? RETURNING seq, round",
                                 (job_id, device)).fetchall()
            rounds = [r[1] for r in deleted]
            waiting = [r[0] for r in db.execute("SELECT round, participants FROM rounds WHERE job_id=? AND "
                                                "state='open'", (job_id,)) if device in json.loads(r[1])]
            db.execute("DELETE FROM checkpoints WHERE job_id=?", (job_id,))
            db.execute("INSERT INTO forgotten VALUES (?, ?, ?, ?) ON CONFLICT (job_id, device) DO UPDATE SET "
                       "contributions = contributions + excluded.contributions, at = excluded.at",
                       (job_id, device, len(rounds), now))
            for round_ in set(rounds) | set(waiting):
                _mark_rejected(db, job_id, round_, device, "forgotten", now)
        self.blobs.remove(r[0] for r in deleted)
        return len(rounds)

    def forgotten(self, job_id: str) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT device FROM forgotten WHERE job_id=? ORDER BY device",
                                              (job_id,))]
