"""Jobs (``jobs``: kind, config, state, summary, counters) and their state changes; a job's
rounds are :mod:`aggregator.storage.rounds`. What moves a job between states is
``aggregator/service/job_lifecycle.py``: here a state is only checked to be one."""

from __future__ import annotations

import json
import sqlite3
import time

import numpy as np

from aggregator.storage.connection import StoreConnection, StoreError
from aggregator.storage.models import add_model_version
from aggregator.storage.pages import key_page, row_count
from aggregator.storage.schema import FINAL_JOB_STATES, JOB_STATES, JobState
from aggregator.storage.settings import read_setting, write_setting

RESTARTED_AT_PREFIX = "restarted_at:"     # settings key: when an operator last queued the stopped job again


class JobRepository(StoreConnection):
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
            before = db.execute("SELECT state FROM jobs WHERE job_id=?", (job_id,)).fetchone()
            if before is not None and before[0] == JobState.STOPPED and state == JobState.QUEUED:
                write_setting(db, RESTARTED_AT_PREFIX + job_id, repr(now))      # with the state: both or neither
            cur = db.execute("UPDATE jobs SET state=?, updated_at=?, "
                             "started_at=CASE WHEN ?='running' AND started_at IS NULL THEN ? ELSE started_at END, "
                             "finished_at=CASE WHEN ? IN ('cancelled','done','failed','stopped') THEN ? ELSE finished_at END, "
                             "summary=COALESCE(?, summary), "
                             # queued again (started, resumed): its end counts its failures afresh
                             "end_failures=CASE WHEN ?='queued' THEN 0 ELSE end_failures END WHERE job_id=?",
                             (state, now, state, now, state, now, json.dumps(summary) if summary else None, state,
                              job_id))
            if cur.rowcount == 0:
                raise StoreError(f"no job {job_id!r}")

    def restarted_at(self, job_id: str) -> float:
        """When the stopped job was last queued again (started or resumed by an operator); 0: never."""
        value = read_setting(self.db, RESTARTED_AT_PREFIX + job_id)
        return float(value) if value is not None else 0.0

    def finish_job(self, job_id: str, state: str, summary: dict, counters: dict,
                   final_model: dict[str, np.ndarray] | None, metrics: dict, round_: int) -> int | None:
        """Final state, summary and final model version of a job, in one transaction."""
        if state not in FINAL_JOB_STATES:
            raise StoreError(f"{state!r} is not a final job state")
        now = time.time()
        with self._tx() as db:
            model_id = (add_model_version(db, job_id, round_, final_model, metrics, final=True)
                        if final_model is not None else None)
            db.execute("UPDATE jobs SET state=?, updated_at=?, finished_at=?, summary=?, counters=? WHERE job_id=?",
                       (state, now, now, json.dumps(summary), json.dumps(counters), job_id))
            return model_id

    def count_end_failure(self, job_id: str) -> int:
        """One more failed try of the job's end: its failures in a row now, kept across restarts
        (``aggregator/service/end_failures.py``: a service restarted within every retry's wait
        counted from 0 again, and tried a failing end for ever)."""
        with self._tx() as db:
            rows = db.execute("UPDATE jobs SET end_failures=end_failures + 1 WHERE job_id=? RETURNING end_failures",
                              (job_id,)).fetchall()      # every row read: the statement ends before the commit
            if not rows:
                raise StoreError(f"no job {job_id!r}")
            return rows[0][0]

    def job(self, job_id: str) -> dict | None:
        r = self.db.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return _job_row(r) if r else None

    def jobs(self, after: tuple[float, str] | None = None, limit: int | None = None, newest: bool = False) -> list[dict]:
        """Jobs in creation order (``newest``: newest first): every one, or the first ``limit`` past
        ``after``, the (created_at, job_id) of the last job of the page before."""
        return [_job_row(r) for r in key_page(self.db, "SELECT * FROM jobs", ("created_at", "job_id"), after, limit,
                                              newest)]

    def job_count(self) -> int:
        return row_count(self.db, "jobs")

    def job_state_counts(self) -> dict[str, int]:
        """state -> how many jobs are in it (counted in SQLite, not read row by row: /metrics)."""
        return dict(self.db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())

    def lately_finished(self, limit: int) -> list[dict]:
        """The last ``limit`` jobs to reach a final state (done, failed, cancelled), the latest last:
        each its ``job_id``, ``kind`` and ``state``."""
        marks = ", ".join("?" * len(FINAL_JOB_STATES))
        rows = self.db.execute(f"SELECT job_id, kind, state FROM jobs WHERE state IN ({marks}) "
                               "ORDER BY finished_at DESC, job_id DESC LIMIT ?", (*FINAL_JOB_STATES, limit)).fetchall()
        return [dict(r) for r in reversed(rows)]

    def next_queued_job(self) -> dict | None:
        r = self.db.execute("SELECT * FROM jobs WHERE state='queued' ORDER BY updated_at, job_id LIMIT 1").fetchone()
        return _job_row(r) if r else None


def _job_row(r: sqlite3.Row) -> dict:
    return {"job_id": r["job_id"], "kind": r["kind"], "config": json.loads(r["config"]), "state": r["state"],
            "created_at": r["created_at"], "updated_at": r["updated_at"], "started_at": r["started_at"],
            "finished_at": r["finished_at"], "summary": json.loads(r["summary"]) if r["summary"] else None,
            "counters": json.loads(r["counters"]) if r["counters"] else {}, "end_failures": r["end_failures"]}
