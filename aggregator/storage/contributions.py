"""Accepted contributions (``contributions``): every accepted result's message id and the length
of its raw, already validated envelope bytes, which are the file ``<seq>.msg`` in the blob
directory (:mod:`aggregator.storage.blob_files`). A row is committed *before* the result's
acknowledgement is published, and its file is written and fsynced (into a name made durable
beforehand) inside the transaction that inserts the row, before that row commits, at FULL and at
NORMAL (NORMAL may lose the last commits on a power cut, never keep a row without its bytes): a
committed row always has its file. Replaying them in commit order (``seq``) through
``job.parse_result``/``job.apply`` rebuilds the job's float64 sums with the same additions in the
same order. Taking contributions out of the replay is :mod:`aggregator.storage.exclusions`."""

from __future__ import annotations

import logging
import sqlite3
import time
from dataclasses import dataclass
from typing import Iterator

from aggregator.storage.blob_files import BlobFileError, BlobNameTaken
from aggregator.storage.connection import StoreConnection, StoreError

log = logging.getLogger("fedfleet.aggregator")


@dataclass(frozen=True)
class StoredContribution:
    seq: int
    job_id: str
    round: int
    device: str
    message_id: str
    payload: bytes
    received_at: float


def _insert(db: sqlite3.Connection, row: tuple) -> int:
    """The seq of a new contributions row (job_id, round, device, message_id, payload_bytes, received_at)."""
    return db.execute("INSERT INTO contributions (job_id, round, device, message_id, payload_bytes, received_at) "
                      "VALUES (?, ?, ?, ?, ?, ?)", row).lastrowid


class ContributionRepository(StoreConnection):
    def add_contribution(self, job_id: str, round_: int, device: str, message_id: str, payload: bytes) -> int:
        """Durably record one accepted result; returns its sequence number. Duplicates raise StoreError
        (before any file is written). The payload file, named by the seq the insert allocated, is
        durable before the row commits."""
        return self.add_contributions([(job_id, round_, device, message_id, payload)])[0]

    def add_contributions(self, results: list[tuple[str, int, str, str, bytes]]) -> list[int]:
        """``add_contribution`` for several (job_id, round, device, message_id, payload) in one
        transaction: each payload file durable, then one commit for all their rows (a writer that
        fell behind pays one commit per batch). All or none: on any error none is recorded."""
        now = time.time()
        seqs = []
        try:
            with self._tx() as db:
                for job_id, round_, device, message_id, payload in results:
                    row = (job_id, round_, device, message_id, len(payload), now)
                    seq = self._write_payload(db, _insert(db, row), row, payload)
                    self._crash("contribution_file_written")
                    db.execute("UPDATE devices SET last_seen=? WHERE device_id=?", (now, device))
                    seqs.append(seq)
                return seqs
        except sqlite3.IntegrityError as exc:
            job_id, round_, device, message_id, _ = results[len(seqs)]
            raise StoreError(f"contribution {message_id} from {device} (round {round_}) is already stored") from exc

    def _write_payload(self, db: sqlite3.Connection, seq: int, row: tuple, payload: bytes) -> int:
        """Write ``payload`` as row ``seq``'s file and return the row's seq. A name holding what no
        store made (a folder of files, which the sweep leaves alone; a link, a FIFO) is passed over:
        the row is inserted again under the next seq SQLite gives. Failing there instead failed every
        insert, SQLite giving the same seq again after each rollback (the job rebuilt at every
        result). Seqs only name rows and order them, so the bytes a restart replays, and their
        order, are the same; once this commits the passed-over seq is below the AUTOINCREMENT mark
        and never given again."""
        while True:
            try:
                self.blobs.write(seq, payload)
                return seq
            except BlobNameTaken as exc:
                log.warning("store %s: %s; the contribution is stored under the next number", self.path, exc)
                db.execute("DELETE FROM contributions WHERE seq=?", (seq,))
                seq = _insert(db, row)

    def holds_message(self, job_id: str, message_id: str) -> bool:
        """Whether the job stored a contribution under ``message_id`` (unique within a job)."""
        return self.db.execute("SELECT 1 FROM contributions WHERE job_id=? AND message_id=?",
                               (job_id, message_id)).fetchone() is not None

    def contributions(self, job_id: str, with_payload: bool = True, canonical: bool = False,
                      after_round: int = 0, through_round: int | None = None) -> Iterator[StoredContribution]:
        """Accepted contributions of rounds > ``after_round`` (and <= ``through_round``), streamed by
        round, in commit order within a round (or by device id then round: ``canonical``). Round order
        is commit order for jobs with one open round at a time; an asynchronous job's one-device rounds
        close out of order."""
        order = "device, round" if canonical else "round, seq"
        upto, bound = ("", ()) if through_round is None else (" AND round<=?", (through_round,))
        for r in self.db.execute("SELECT seq, job_id, round, device, message_id, payload_bytes, received_at FROM "
                                 f"contributions WHERE job_id=? AND round>?{upto} ORDER BY {order}",
                                 (job_id, after_round, *bound)):
            payload = self._payload(r[0], r[5], job_id) if with_payload else b""
            yield StoredContribution(r[0], r[1], r[2], r[3], r[4], payload, r[6])

    def contribution_of(self, job_id: str, round_: int, device: str) -> StoredContribution | None:
        """The one contribution of ``device`` to ``round_`` the job holds (with its payload), or None."""
        r = self.db.execute("SELECT seq, job_id, round, device, message_id, payload_bytes, received_at FROM "
                            "contributions WHERE job_id=? AND round=? AND device=?", (job_id, round_, device)).fetchone()
        return None if r is None else StoredContribution(r[0], r[1], r[2], r[3], r[4], self._payload(r[0], r[5], job_id),
                                                         r[6])

    def contribution_payload(self, job_id: str, seq: int) -> bytes:
        """The stored bytes of one contribution (``seq`` from :meth:`contributions`)."""
        row = self.db.execute("SELECT payload_bytes FROM contributions WHERE job_id=? AND seq=?", (job_id, seq)).fetchone()
        if row is None:
            raise StoreError(f"job {job_id!r} has no contribution {seq}")
        return self._payload(seq, row[0], job_id)

    def _payload(self, seq: int, nbytes: int, job_id: str) -> bytes:
        try:
            return self.blobs.read(seq, nbytes)
        except BlobFileError as exc:
            raise StoreError(f"contribution {seq} of job {job_id!r}: {exc} (a store is its DB file and its "
                             f"blob directory: restore them together)") from exc

    def drop_unaccepted(self, job_id: str, round_: int, accepted: set[tuple[str, str]], earlier: bool = False) -> int:
        """Delete the job's rows of round ``round_`` (and of every earlier round, ``earlier``) whose
        (device, message id) is not in ``accepted`` (a shard's orphans, once its coordinator closed
        the round: results it stored that were refused, or stored and re-sent under another id after
        a kill), in one transaction; their files go once it committed. Returns how many rows went."""
        with self._tx() as db:
            rows = db.execute("SELECT seq, device, message_id FROM contributions WHERE job_id=? AND "
                              f"round{'<=' if earlier else '='}?", (job_id, round_)).fetchall()
            orphans = [seq for seq, device, message_id in rows if (device, message_id) not in accepted]
            db.executemany("DELETE FROM contributions WHERE seq=?", [(seq,) for seq in orphans])
        self.blobs.remove(orphans)          # after the commit: a crash between leaves files the next open sweeps
        return len(orphans)

    def contribution_count(self, job_id: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM contributions WHERE job_id=?", (job_id,)).fetchone()[0]

    def jobs_of_device(self, device: str) -> list[str]:
        """Jobs holding stored contributions of ``device``."""
        return [r[0] for r in self.db.execute(
            "SELECT DISTINCT job_id FROM contributions WHERE device=? ORDER BY job_id", (device,))]
