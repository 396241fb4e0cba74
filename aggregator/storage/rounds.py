"""A job's rounds: one row per opened round (``rounds``: participants, the task message id sent
to each, the deadline, the job's bookkeeping right after it picked them; at close, the outcome),
the declines and rejected results of open rounds (``round_events``, so a restored round waits for
exactly the devices it was still waiting for) and the job's state as of its last closed round
(``checkpoints``, written in the round-close transaction, so a restart replays only the
contributions of the open round instead of the whole job)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

from protocols.files import read_npz

from aggregator.storage.connection import StoreConnection, StoreError
from aggregator.storage.evaluations import append_evaluation
from aggregator.storage.models import add_model_version, npz_bytes


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


class RoundRepository(StoreConnection):
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
                    checkpoint: tuple[dict[str, np.ndarray], dict] | None = None,
                    evaluation: dict | None = None) -> int | None:
        """Mark the round closed and, in the same transaction, record the model version it produced,
        the job's state after it (``checkpoint`` = (state_dict, contributed[, replay_after]): a restart
        replays the contributions of rounds after ``replay_after``, this round by default) and the
        evaluation of its model, if any (appended to the job's history)."""
        with self._tx() as db:
            if evaluation is not None:
                append_evaluation(db, job_id, evaluation)
            if checkpoint is not None:
                _write_checkpoint(db, job_id, checkpoint[2] if len(checkpoint) > 2 else round_, *checkpoint[:2])
            cur = db.execute("UPDATE rounds SET state='closed', closed_at=?, outcome=?, "
                             "bytes_in=COALESCE(?, bytes_in) WHERE job_id=? AND round=? AND state='open'",
                             (time.time(), json.dumps(outcome), bytes_in, job_id, round_))
            if cur.rowcount == 0:
                raise StoreError(f"round {round_} of job {job_id!r} is not open")
            if counters is not None:
                db.execute("UPDATE jobs SET counters=? WHERE job_id=?", (json.dumps(counters), job_id))
            if model is None:
                return None
            return add_model_version(db, job_id, round_, model, metrics or {}, final=False)

    def replace_checkpoint_state(self, job_id: str, state: dict[str, np.ndarray], contributed: dict) -> None:
        """The job's checkpoint, as of the same closed round, now holds ``state``: a change the job made
        after that round that a restart must not make again (DP Fed3R's release at the job's end)."""
        with self._tx() as db:
            r = db.execute("SELECT round FROM checkpoints WHERE job_id=?", (job_id,)).fetchone()
            if r is None:
                raise StoreError(f"job {job_id!r} has no checkpoint to replace")
            _write_checkpoint(db, job_id, r["round"], state, contributed)

    def checkpoint(self, job_id: str) -> tuple[int, dict[str, np.ndarray], dict] | None:
        """(round, state_dict, contributed) as of the job's last closed round, if one was recorded."""
        r = self.db.execute("SELECT round, state, contributed FROM checkpoints WHERE job_id=?", (job_id,)).fetchone()
        if r is None:
            return None
        return r["round"], read_npz(bytes(r["state"])), json.loads(r["contributed"])

    def rounds(self, job_id: str, newest: int | None = None) -> list[StoredRound]:
        """The job's rounds in order; with ``newest``, only the last that many (what the dashboard
        shows each second: a long job's thousands of rounds were parsed for it every time)."""
        rows = self.db.execute("SELECT * FROM rounds WHERE job_id=? ORDER BY round", (job_id,)) if newest is None \
            else reversed(self.db.execute("SELECT * FROM rounds WHERE job_id=? ORDER BY round DESC LIMIT ?",
                                          (job_id, newest)).fetchall())
        return [_stored_round(r) for r in rows]

    def round_of(self, job_id: str, round_: int) -> StoredRound | None:
        """One round of the job (None if it has none of that number), read alone."""
        row = self.db.execute("SELECT * FROM rounds WHERE job_id=? AND round=?", (job_id, round_)).fetchone()
        return None if row is None else _stored_round(row)

    def round_count(self, job_id: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM rounds WHERE job_id=?", (job_id,)).fetchone()[0]

    def first_declines(self, job_id: str, reasons: tuple[str, ...], since: float = 0.0) -> dict[str, int]:
        """device -> the first round of the job it declined for one of ``reasons`` (whole words), of
        the declines recorded at or after ``since`` (unix s)."""
        marks = ", ".join("?" * len(reasons))
        return {r["device"]: r["first"] for r in self.db.execute(
            f"SELECT device, MIN(round) AS first FROM round_events WHERE job_id=? AND event='declined' "
            f"AND reason IN ({marks}) AND at>=? GROUP BY device", (job_id, *reasons, since))}

    def round_events(self, job_id: str, round_: int) -> list[dict]:
        return [dict(r) for r in self.db.execute(
            "SELECT device, event, reason, at FROM round_events WHERE job_id=? AND round=? ORDER BY at",
            (job_id, round_))]


def _write_checkpoint(db, job_id: str, replay_after: int, state: dict[str, np.ndarray], contributed: dict) -> None:
    db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?)",
               (job_id, replay_after, npz_bytes(state), json.dumps(contributed), time.time()))


def _stored_round(r) -> StoredRound:
    return StoredRound(r["job_id"], r["round"], r["state"], tuple(json.loads(r["participants"])),
                       json.loads(r["tasks"]), json.loads(r["bookkeeping"]), r["opened_at"], r["deadline"],
                       r["closed_at"], json.loads(r["outcome"]) if r["outcome"] else None, r["bytes_in"])
