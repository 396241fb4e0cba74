"""A job's history of provisional-model evaluations (``evaluations``: the accuracy curves), one
JSON entry per evaluation, in the order they were made."""

from __future__ import annotations

import json

from aggregator.storage.connection import StoreConnection


def append_evaluation(db, job_id: str, entry: dict) -> None:
    """Append ``entry`` to the job's history inside the caller's transaction (a round's close
    commits its evaluation with it)."""
    (n,) = db.execute("SELECT COUNT(*) FROM evaluations WHERE job_id=?", (job_id,)).fetchone()
    db.execute("INSERT INTO evaluations VALUES (?, ?, ?)", (job_id, n, json.dumps(entry)))


class EvaluationRepository(StoreConnection):
    def add_evaluation(self, job_id: str, entry: dict) -> None:
        with self._tx() as db:
            append_evaluation(db, job_id, entry)

    def evaluations(self, job_id: str) -> list[dict]:
        return [json.loads(r[0]) for r in self.db.execute(
            "SELECT entry FROM evaluations WHERE job_id=? ORDER BY idx", (job_id,))]
