"""Model versions (``models``: npz bytes, their sha256, the round that made them, the parent
version = lineage). A version is added inside the transaction of what produced it: a round close,
a job's finish, a re-solve after forgetting a device (:func:`add_model_version`)."""

from __future__ import annotations

import hashlib
import io
import json
import sqlite3
import time

import numpy as np

from aggregator.storage.connection import StoreConnection
from aggregator.storage.pages import key_page, row_count

MODEL_COLUMNS = ("model_id, job_id, version, round, parent_id, contributions, sha256, metrics, final, created_at, "
                 "length(arrays) AS nbytes")


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


def add_model_version(db: sqlite3.Connection, job_id: str, round_: int, arrays: dict[str, np.ndarray],
                      metrics: dict, final: bool) -> int:
    """The job's next version, child of its latest, inside the caller's transaction; its model_id."""
    parent = db.execute("SELECT model_id, version FROM models WHERE job_id=? ORDER BY version DESC LIMIT 1",
                        (job_id,)).fetchone()
    version = parent["version"] + 1 if parent else 1
    (contribs,) = db.execute("SELECT COUNT(*) FROM contributions WHERE job_id=?", (job_id,)).fetchone()
    cur = db.execute("INSERT INTO models (job_id, version, round, parent_id, contributions, sha256, arrays, "
                     "metrics, final, created_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                     (job_id, version, round_, parent["model_id"] if parent else None, contribs,
                      arrays_sha256(arrays), npz_bytes(arrays), json.dumps(metrics), int(final), time.time()))
    return cur.lastrowid


class ModelRepository(StoreConnection):
    def models(self, job_id: str | None = None, after: int | None = None, limit: int | None = None,
               newest: bool = False) -> list[dict]:
        """Model versions in id (creation) order (``newest``: newest first), of one job or every job:
        every one, or the first ``limit`` past model id ``after``."""
        where, args = ("job_id=?", (job_id,)) if job_id else ("", ())
        return [_model_row(r) for r in key_page(self.db, f"SELECT {MODEL_COLUMNS} FROM models", ("model_id",),
                                                None if after is None else (after,), limit, newest, where, args)]

    def model_count(self, job_id: str | None = None) -> int:
        return row_count(self.db, "models", *(("job_id=?", (job_id,)) if job_id else ()))

    def model(self, model_id: int) -> dict | None:
        r = self.db.execute(f"SELECT {MODEL_COLUMNS} FROM models WHERE model_id=?", (model_id,)).fetchone()
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

    def replace_final_model(self, job_id: str, arrays: dict[str, np.ndarray], metrics: dict, round_: int) -> int:
        """A finished job's final model re-solved (after forgetting a device): a new final version,
        child of the previous one, which stops being final."""
        with self._tx() as db:
            db.execute("UPDATE models SET final=0 WHERE job_id=?", (job_id,))
            return add_model_version(db, job_id, round_, arrays, metrics, final=True)


def _model_row(r: sqlite3.Row) -> dict:
    d = dict(r)
    d["metrics"] = json.loads(d["metrics"])
    d["final"] = bool(d["final"])
    return d
