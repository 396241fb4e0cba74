"""Durable aggregator state in one SQLite file (WAL) and, beside it, a directory of contribution
payload files (``<db path>.blobs/``, :mod:`aggregator.storage.blob_files`): a thin adapter, no protocol logic.

What is stored, and why that is enough to resume a job bit for bit after a crash:

* ``devices``        enrolment (Ed25519 public key, MQTT password hash, revoked or not), last seen,
                     profile (the presence ``info``), cluster.
* ``jobs``           kind, config, state (created/queued/running/paused/cancelled/done/stopped).
* ``rounds``         one row per opened round: participants, the task message id sent to each,
                     the wall-clock deadline and the job's *bookkeeping* right after it picked the
                     participants (round number, attempts, RNG state); at close, the outcome.
* ``round_events``   declines and rejected results of open rounds (so a restored round waits for
                     exactly the devices it was still waiting for).
* ``contributions``  every accepted result: its message id and the length of the raw, already
                     validated envelope bytes, which are the file ``<seq>.msg`` in the blob
                     directory; committed *before* the acknowledgement is published. Replaying
                     them in commit order (``seq``) through ``job.parse_result``/``job.apply``
                     rebuilds the job's float64 sums with the same additions in the same order.
* ``quarantine``     accepted contributions that later failed to apply (e.g. statistics whose
                     solve fails): moved out of ``contributions`` with the reason, so a restart
                     never replays them; the device counts as rejected in its round.
* ``checkpoints``    the job's state (``job.state_dict()``, exact float64 sums) as of its last
                     closed round, written in the round-close transaction, so a restart replays
                     only the contributions of the open round instead of the whole job.
* ``evaluations``    the history of provisional-model evaluations (accuracy curves).
* ``models``         model versions (npz bytes, sha256, parent version = lineage).
* ``clusters``       named device groups (clustered jobs assign ``devices.cluster``).
* ``settings``       operator settings that outlive a process (the fleet mode: open | enrolled).

Durability: ``synchronous=FULL`` in WAL mode makes every commit durable before it returns, so a
caller that commits and *then* acknowledges never acknowledges something it could lose. Each
public write method is one transaction. A contribution's payload file is written and fsynced (into
a name made durable beforehand) inside the transaction that inserts its row, before that row
commits, at FULL and at NORMAL (NORMAL may lose the last commits on a power cut, never keep a row
without its bytes): a committed row always has its file. Files of deleted rows (quarantine,
forget) are removed after the delete commits. A crash between the two leaves bytes of no row,
which opening the store removes; it does so holding the write lock, so it never races a writer of
another process between its file and its commit. The payloads are written once and read back as stored; no checksum is
kept beside them (the row's length catches a torn or truncated file; a result's own payload sha256
is inside its envelope for a reader that wants to re-verify it). The writer is the aggregator's
service thread; readers (the admin API thread) get their own connection per thread (WAL lets them
read while it writes).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from aggregator.storage.blob_files import BlobFileError, BlobFiles
from aggregator.service.crash_points import CrashPoints
from aggregator.storage.schema import JobState, FINAL_JOB_STATES, JOB_STATES, MIGRATE_FROM_V1, SCHEMA, SCHEMA_VERSION

log = logging.getLogger("fedfleet.aggregator")
SCREEN_EXEMPT_PREFIX = "screen_exempt:"     # settings key: the devices a job's fleet screen spares


class StoreError(RuntimeError):
    """The store refuses an operation (unknown job, config mismatch, bad state transition)."""


@dataclass(frozen=True)
class StoredRound:
    job_id: str
    round: int
    state: str
    participants: tuple[str, ...]
    tasks: dict[str, str]
    bookkeeping: dict
    opened_at: float
    deadline: float
    closed_at: float | None
    outcome: dict | None
    bytes_in: int


@dataclass(frozen=True)
class StoredContribution:
    seq: int
    job_id: str
    round: int
    device: str
    message_id: str
    payload: bytes
    received_at: float


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def arrays_sha256(arrays: dict[str, np.ndarray]) -> str:
    """Digest of the arrays' names, dtypes, shapes and bytes (independent of npz container details)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


class Store:
    def __init__(self, path: str | Path, synchronous: str = "FULL"):
        if synchronous not in ("FULL", "NORMAL", "OFF"):
            raise ValueError("synchronous must be FULL, NORMAL or OFF")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.synchronous = synchronous
        self._local = threading.local()
        self.commit_seconds = 0.0      # time spent in write transactions, payload files included
        self.commits = 0
        self.blobs = BlobFiles(self.path.with_name(self.path.name + ".blobs"), durable=synchronous != "OFF")
        self._crash = CrashPoints.from_env()
        self.db.executescript(f"BEGIN IMMEDIATE; {SCHEMA} COMMIT;")
        migrated = False
        with self._tx() as db:
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif migrated := row[0] == "1":
                self._migrate_from_v1(db)
            elif row[0] == "2":             # the deployment tables, created above, are all version 3 adds
                db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
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

    # ------------------------------------------------------------------ connections
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

    class _Tx:
        def __init__(self, store: "Store"):
            self.store = store

        def __enter__(self) -> sqlite3.Connection:
            self.t0 = time.perf_counter()
            self.store.db.execute("BEGIN IMMEDIATE")
            return self.store.db

        def __exit__(self, exc_type, exc, tb):
            if exc_type is None:
                self.store.db.execute("COMMIT")
            else:
                self.store.db.execute("ROLLBACK")
            self.store.commit_seconds += time.perf_counter() - self.t0
            self.store.commits += 1
            return False

    def _tx(self) -> "Store._Tx":
        return Store._Tx(self)

    # ------------------------------------------------------------------ devices
    def enroll_device(self, device_id: str, public_key: bytes | None, mqtt_password_hash: str | None) -> None:
        """Enrol (or re-enrol a revoked) device; re-enrolling an active device is refused."""
        now = time.time()
        with self._tx() as db:
            row = db.execute("SELECT status FROM devices WHERE device_id=?", (device_id,)).fetchone()
            if row is not None and row["status"] == "enrolled":
                raise StoreError(f"device {device_id!r} is already enrolled; revoke it first")
            db.execute("INSERT INTO devices (device_id, status, public_key, mqtt_password_hash, enrolled_at) "
                       "VALUES (?, 'enrolled', ?, ?, ?) ON CONFLICT(device_id) DO UPDATE SET status='enrolled', "
                       "public_key=excluded.public_key, mqtt_password_hash=excluded.mqtt_password_hash, "
                       "enrolled_at=excluded.enrolled_at, revoked_at=NULL",
                       (device_id, public_key, mqtt_password_hash, now))

    def revoke_device(self, device_id: str) -> None:
        with self._tx() as db:
            cur = db.execute("UPDATE devices SET status='revoked', revoked_at=?, mqtt_password_hash=NULL, online=0 "
                             "WHERE device_id=? AND status='enrolled'", (time.time(), device_id))
            if cur.rowcount == 0:
                raise StoreError(f"device {device_id!r} is not enrolled")

    def device_seen(self, device_id: str, online: bool | None = None, profile: dict | None = None,
                    at: float | None = None) -> None:
        """Record presence / activity of a device in the table (others are not learnt from traffic)."""
        at = time.time() if at is None else at
        with self._tx() as db:
            db.execute("UPDATE devices SET last_seen=? WHERE device_id=?", (at, device_id))
            if online is not None:
                db.execute("UPDATE devices SET online=? WHERE device_id=?", (int(online), device_id))
            if profile is not None:
                db.execute("UPDATE devices SET profile=? WHERE device_id=?", (json.dumps(profile), device_id))

    def mark_all_offline(self) -> None:
        """At start-up: presence is re-learnt from the broker's retained messages."""
        with self._tx() as db:
            db.execute("UPDATE devices SET online=0")

    def set_cluster(self, device_id: str, cluster_id: str | None) -> None:
        with self._tx() as db:
            db.execute("UPDATE devices SET cluster=? WHERE device_id=?", (cluster_id, device_id))

    def devices(self) -> list[dict]:
        return [_device_row(r) for r in self.db.execute("SELECT * FROM devices ORDER BY device_id")]

    def device(self, device_id: str) -> dict | None:
        r = self.db.execute("SELECT * FROM devices WHERE device_id=?", (device_id,)).fetchone()
        return _device_row(r) if r else None

    def enrolled_keys(self) -> dict[str, bytes | None]:
        """Active devices -> raw Ed25519 public key (None for devices enrolled without one)."""
        return {r["device_id"]: (bytes(r["public_key"]) if r["public_key"] is not None else None)
                for r in self.db.execute("SELECT device_id, public_key FROM devices WHERE status='enrolled'")}

    def password_hashes(self) -> dict[str, str]:
        return {r["device_id"]: r["mqtt_password_hash"] for r in self.db.execute(
            "SELECT device_id, mqtt_password_hash FROM devices WHERE status='enrolled' "
            "AND mqtt_password_hash IS NOT NULL ORDER BY device_id")}

    # ------------------------------------------------------------------ jobs
    def create_job(self, job_id: str, kind: str, config: dict, state: JobState = JobState.CREATED) -> None:
        if state not in JOB_STATES:
            raise StoreError(f"unknown job state {state!r}")
        now = time.time()
        with self._tx() as db:
            if db.execute("SELECT 1 FROM jobs WHERE job_id=?", (job_id,)).fetchone():
                raise StoreError(f"job {job_id!r} already exists")
            db.execute("INSERT INTO jobs (job_id, kind, config, state, created_at, updated_at) VALUES (?,?,?,?,?,?)",
                       (job_id, kind, json.dumps(config, sort_keys=True), state, now, now))

    def set_job_state(self, job_id: str, state: str, summary: dict | None = None) -> None:
        if state not in JOB_STATES:
            raise StoreError(f"unknown job state {state!r}")
        now = time.time()
        with self._tx() as db:
            cur = db.execute("UPDATE jobs SET state=?, updated_at=?, "
                             "started_at=CASE WHEN ?='running' AND started_at IS NULL THEN ? ELSE started_at END, "
                             "finished_at=CASE WHEN ? IN ('cancelled','done','failed','stopped') THEN ? ELSE finished_at END, "
                             "summary=COALESCE(?, summary) WHERE job_id=?",
                             (state, now, state, now, state, now, json.dumps(summary) if summary else None, job_id))
            if cur.rowcount == 0:
                raise StoreError(f"no job {job_id!r}")

    def job(self, job_id: str) -> dict | None:
        r = self.db.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return _job_row(r) if r else None

    def jobs(self) -> list[dict]:
        return [_job_row(r) for r in self.db.execute("SELECT * FROM jobs ORDER BY created_at, job_id")]

    def next_queued_job(self) -> dict | None:
        r = self.db.execute("SELECT * FROM jobs WHERE state='queued' ORDER BY updated_at, job_id LIMIT 1").fetchone()
        return _job_row(r) if r else None

    # ------------------------------------------------------------------ rounds
    def open_round(self, job_id: str, round_: int, participants: list[str], tasks: dict[str, str],
                   bookkeeping: dict, deadline: float) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO rounds (job_id, round, state, participants, tasks, bookkeeping, opened_at, "
                       "deadline) VALUES (?, ?, 'open', ?, ?, ?, ?, ?)",
                       (job_id, round_, json.dumps(sorted(participants)), json.dumps(tasks),
                        json.dumps(bookkeeping), time.time(), deadline))

    def add_round_event(self, job_id: str, round_: int, device: str, event: str, reason: str) -> None:
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO round_events VALUES (?, ?, ?, ?, ?, ?)",
                       (job_id, round_, device, event, reason, time.time()))

    def close_round(self, job_id: str, round_: int, outcome: dict, model: dict[str, np.ndarray] | None = None,
                    metrics: dict | None = None, bytes_in: int | None = None, counters: dict | None = None,
                    checkpoint: tuple[dict[str, np.ndarray], dict] | None = None) -> int | None:
        """Mark the round closed and, in the same transaction, record the model version it produced and
        the job's state after it (``checkpoint`` = (state_dict, contributed[, replay_after]): a restart
        replays the contributions of rounds after ``replay_after``, this round by default)."""
        with self._tx() as db:
            if checkpoint is not None:
                replay_after = checkpoint[2] if len(checkpoint) > 2 else round_
                db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?)",
                           (job_id, replay_after, npz_bytes(checkpoint[0]), json.dumps(checkpoint[1]), time.time()))
            cur = db.execute("UPDATE rounds SET state='closed', closed_at=?, outcome=?, "
                             "bytes_in=COALESCE(?, bytes_in) WHERE job_id=? AND round=? AND state='open'",
                             (time.time(), json.dumps(outcome), bytes_in, job_id, round_))
            if cur.rowcount == 0:
                raise StoreError(f"round {round_} of job {job_id!r} is not open")
            if counters is not None:
                db.execute("UPDATE jobs SET counters=? WHERE job_id=?", (json.dumps(counters), job_id))
            if model is None:
                return None
            return self._add_model(db, job_id, round_, model, metrics or {}, final=False)

    def finish_job(self, job_id: str, state: str, summary: dict, counters: dict,
                   final_model: dict[str, np.ndarray] | None, metrics: dict, round_: int) -> int | None:
        """Final state, summary and final model version of a job, in one transaction."""
        if state not in FINAL_JOB_STATES:
            raise StoreError(f"{state!r} is not a final job state")
        now = time.time()
        with self._tx() as db:
            model_id = (self._add_model(db, job_id, round_, final_model, metrics, final=True)
                        if final_model is not None else None)
            db.execute("UPDATE jobs SET state=?, updated_at=?, finished_at=?, summary=?, counters=? WHERE job_id=?",
                       (state, now, now, json.dumps(summary), json.dumps(counters), job_id))
            return model_id

    def checkpoint(self, job_id: str) -> tuple[int, dict[str, np.ndarray], dict] | None:
        """(round, state_dict, contributed) as of the job's last closed round, if one was recorded."""
        r = self.db.execute("SELECT round, state, contributed FROM checkpoints WHERE job_id=?", (job_id,)).fetchone()
        if r is None:
            return None
        with np.load(io.BytesIO(bytes(r["state"]))) as z:
            return r["round"], {k: z[k] for k in z.files}, json.loads(r["contributed"])

    def rounds(self, job_id: str) -> list[StoredRound]:
        return [StoredRound(r["job_id"], r["round"], r["state"], tuple(json.loads(r["participants"])),
                            json.loads(r["tasks"]), json.loads(r["bookkeeping"]), r["opened_at"], r["deadline"],
                            r["closed_at"], json.loads(r["outcome"]) if r["outcome"] else None, r["bytes_in"])
                for r in self.db.execute("SELECT * FROM rounds WHERE job_id=? ORDER BY round", (job_id,))]

    def round_events(self, job_id: str, round_: int) -> list[dict]:
        return [dict(r) for r in self.db.execute(
            "SELECT device, event, reason, at FROM round_events WHERE job_id=? AND round=? ORDER BY at",
            (job_id, round_))]

    # ------------------------------------------------------------------ contributions
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
                    seq = db.execute("INSERT INTO contributions (job_id, round, device, message_id, payload_bytes, "
                                     "received_at) VALUES (?, ?, ?, ?, ?, ?)",
                                     (job_id, round_, device, message_id, len(payload), now)).lastrowid
                    self.blobs.write(seq, payload)
                    self._crash("contribution_file_written")
                    db.execute("UPDATE devices SET last_seen=? WHERE device_id=?", (now, device))
                    seqs.append(seq)
                return seqs
        except sqlite3.IntegrityError as exc:
            job_id, round_, device, message_id, _ = results[len(seqs)]
            raise StoreError(f"contribution {message_id} from {device} (round {round_}) is already stored") from exc

    def contributions(self, job_id: str, with_payload: bool = True, canonical: bool = False,
                      after_round: int = 0) -> Iterator[StoredContribution]:
        """Accepted contributions of rounds > ``after_round``, streamed by round, in commit order within
        a round (or by device id then round: ``canonical``). Round order is commit order for jobs with
        one open round at a time; an asynchronous job's one-device rounds close out of order."""
        order = "device, round" if canonical else "round, seq"
        for r in self.db.execute("SELECT seq, job_id, round, device, message_id, payload_bytes, received_at FROM "
                                 f"contributions WHERE job_id=? AND round>? ORDER BY {order}", (job_id, after_round)):
            payload = self._payload(r[0], r[5], job_id) if with_payload else b""
            yield StoredContribution(r[0], r[1], r[2], r[3], r[4], payload, r[6])

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

    def contribution_counts(self, job_id: str) -> dict[int, int]:
        return {r[0]: r[1] for r in self.db.execute(
            "SELECT round, COUNT(*) FROM contributions WHERE job_id=? GROUP BY round", (job_id,))}

    # ------------------------------------------------------------------ quarantine
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
            db.execute("INSERT OR REPLACE INTO round_events VALUES (?, ?, ?, ?, ?, ?)",
                       (job_id, round_, device, "rejected", f"quarantined: {reason[:900]}", now))
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
                row = db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
                exempt = sorted(set(json.loads(row[0]) if row else []) | {device})
                db.execute("INSERT OR REPLACE INTO settings VALUES (?, ?)", (key, json.dumps(exempt)))
        return len(released)

    def screen_exempt(self, job_id: str) -> set[str]:
        """Devices an operator released from the job's quarantine: its fleet screen spares them."""
        return set(json.loads(self.setting(SCREEN_EXEMPT_PREFIX + job_id) or "[]"))

    def quarantined(self, job_id: str) -> list[dict]:
        return [dict(r) for r in self.db.execute(
            "SELECT round, device, message_id, reason, at FROM quarantine WHERE job_id=? ORDER BY at", (job_id,))]

    # ------------------------------------------------------------------ unlearning
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
                db.execute("INSERT OR REPLACE INTO round_events VALUES (?, ?, ?, 'rejected', 'forgotten', ?)",
                           (job_id, round_, device, now))
        self.blobs.remove(r[0] for r in deleted)
        return len(rounds)

    def forgotten(self, job_id: str) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT device FROM forgotten WHERE job_id=? ORDER BY device",
                                              (job_id,))]

    def jobs_of_device(self, device: str) -> list[str]:
        """Jobs holding stored contributions of ``device``."""
        return [r[0] for r in self.db.execute(
            "SELECT DISTINCT job_id FROM contributions WHERE device=? ORDER BY job_id", (device,))]

    def replace_final_model(self, job_id: str, arrays: dict[str, np.ndarray], metrics: dict, round_: int) -> int:
        """A finished job's final model re-solved (after forgetting a device): a new final version,
        child of the previous one, which stops being final."""
        with self._tx() as db:
            db.execute("UPDATE models SET final=0 WHERE job_id=?", (job_id,))
            return self._add_model(db, job_id, round_, arrays, metrics, final=True)

    # ------------------------------------------------------------------ evaluations and models
    def add_evaluation(self, job_id: str, entry: dict) -> None:
        with self._tx() as db:
            (n,) = db.execute("SELECT COUNT(*) FROM evaluations WHERE job_id=?", (job_id,)).fetchone()
            db.execute("INSERT INTO evaluations VALUES (?, ?, ?)", (job_id, n, json.dumps(entry)))

    def evaluations(self, job_id: str) -> list[dict]:
        return [json.loads(r[0]) for r in self.db.execute(
            "SELECT entry FROM evaluations WHERE job_id=? ORDER BY idx", (job_id,))]

    def _add_model(self, db, job_id, round_, arrays, metrics, final) -> int:
        parent = db.execute("SELECT model_id, version FROM models WHERE job_id=? ORDER BY version DESC LIMIT 1",
                            (job_id,)).fetchone()
        version = parent["version"] + 1 if parent else 1
        (contribs,) = db.execute("SELECT COUNT(*) FROM contributions WHERE job_id=?", (job_id,)).fetchone()
        cur = db.execute("INSERT INTO models (job_id, version, round, parent_id, contributions, sha256, arrays, "
                         "metrics, final, created_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                         (job_id, version, round_, parent["model_id"] if parent else None, contribs,
                          arrays_sha256(arrays), npz_bytes(arrays), json.dumps(metrics), int(final), time.time()))
        return cur.lastrowid

    def models(self, job_id: str | None = None) -> list[dict]:
        q = "SELECT model_id, job_id, version, round, parent_id, contributions, sha256, metrics, final, created_at, " \
            "length(arrays) AS nbytes FROM models"
        rows = (self.db.execute(q + " WHERE job_id=? ORDER BY model_id", (job_id,)) if job_id
                else self.db.execute(q + " ORDER BY model_id"))
        return [_model_row(r) for r in rows]

    def model(self, model_id: int) -> dict | None:
        r = self.db.execute("SELECT model_id, job_id, version, round, parent_id, contributions, sha256, metrics, "
                            "final, created_at, length(arrays) AS nbytes FROM models WHERE model_id=?",
                            (model_id,)).fetchone()
        return _model_row(r) if r else None

    def model_bytes(self, model_id: int) -> bytes | None:
        r = self.db.execute("SELECT arrays FROM models WHERE model_id=?", (model_id,)).fetchone()
        return bytes(r[0]) if r else None

    def lineage(self, model_id: int) -> list[dict]:
        """The model and its ancestors, newest first, each with the devices of the round that made it."""
        out, current = [], self.model(model_id)
        while current is not None:
            r = self.db.execute("SELECT outcome FROM rounds WHERE job_id=? AND round=?",
                                (current["job_id"], current["round"])).fetchone()
            outcome = json.loads(r[0]) if r and r[0] and not current["final"] else {}   # final: a re-sum, adds none
            out.append({**current, "accepted": outcome.get("accepted", [])})
            current = self.model(current["parent_id"]) if current["parent_id"] else None
        return out

    # ------------------------------------------------------------------ settings
    def setting(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_setting(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO settings VALUES (?, ?)", (key, value))

    # ------------------------------------------------------------------ clusters
    def upsert_cluster(self, cluster_id: str, label: str = "", job_id: str | None = None,
                       model_id: int | None = None) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO clusters VALUES (?, ?, ?, ?, ?) ON CONFLICT(cluster_id) DO UPDATE SET "
                       "label=excluded.label, job_id=excluded.job_id, model_id=excluded.model_id",
                       (cluster_id, label, job_id, model_id, time.time()))

    def clusters(self) -> list[dict]:
        rows = self.db.execute(
            "SELECT c.cluster_id, c.label, c.job_id, c.model_id, c.created_at, "
            "(SELECT COUNT(*) FROM devices d WHERE d.cluster=c.cluster_id) AS devices FROM clusters c "
            "ORDER BY c.cluster_id")
        return [dict(r) for r in rows]


def _device_row(r: sqlite3.Row) -> dict:
    return {"device_id": r["device_id"], "status": r["status"],
            "public_key": bytes(r["public_key"]).hex() if r["public_key"] is not None else None,
            "enrolled_at": r["enrolled_at"], "revoked_at": r["revoked_at"], "last_seen": r["last_seen"],
            "online": bool(r["online"]), "profile": json.loads(r["profile"] or "{}"), "cluster": r["cluster"]}


def _job_row(r: sqlite3.Row) -> dict:
    return {"job_id": r["job_id"], "kind": r["kind"], "config": json.loads(r["config"]), "state": r["state"],
            "created_at": r["created_at"], "updated_at": r["updated_at"], "started_at": r["started_at"],
            "finished_at": r["finished_at"], "summary": json.loads(r["summary"]) if r["summary"] else None,
            "counters": json.loads(r["counters"]) if r["counters"] else {}}


def _model_row(r: sqlite3.Row) -> dict:
    d = dict(r)
    d["metrics"] = json.loads(d["metrics"])
    d["final"] = bool(d["final"])
    return d
