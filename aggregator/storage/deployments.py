"""The deployment tables (``deployments``, ``deployment_devices`` in ``schema.py``): every state
change of a rollout and every assignment published, so a restarted aggregator resumes the same
deployment and re-sends nothing a device already has. Written by the deployment controller alone
(its own thread; SQLite serialises it with the service's writes)."""

from __future__ import annotations

import json
import time

from aggregator.storage.devices import enrolments as enrolments_of
from aggregator.storage.pages import key_page, row_count
from aggregator.storage.store import Store, StoreError


class DeploymentStore:
    def __init__(self, store: Store):
        self.store = store

    def create(self, deployment_id: str, model_id: int, state: str, spec: dict) -> None:
        now = time.time()
        with self.store._tx() as db:
            if db.execute("SELECT 1 FROM deployments WHERE deployment_id=?", (deployment_id,)).fetchone():
                raise StoreError(f"deployment {deployment_id!r} already exists")
            db.execute("INSERT INTO deployments VALUES (?, ?, ?, ?, ?, ?)",
                       (deployment_id, model_id, state, json.dumps(spec), now, now))

    def save(self, deployment_id: str, state: str, spec: dict) -> None:
        with self.store._tx() as db:
            db.execute("UPDATE deployments SET state=?, spec=?, updated_at=? WHERE deployment_id=?",
                       (state, json.dumps(spec), time.time(), deployment_id))

    def get(self, deployment_id: str) -> dict | None:
        r = self.store.db.execute("SELECT * FROM deployments WHERE deployment_id=?", (deployment_id,)).fetchone()
        return _row(r) if r else None

    def unused_id(self, base: str) -> str:
        """``base`` if no deployment has that id, else the first of ``base-2``, ``base-3``, ... none has."""
        # base is m<model id>-<second>: no LIKE wildcard in it
        taken = {r[0] for r in self.store.db.execute(
            "SELECT deployment_id FROM deployments WHERE deployment_id = ? OR deployment_id LIKE ?", (base, base + "-%"))}
        return next(c for n in range(1, len(taken) + 2) if (c := base if n == 1 else f"{base}-{n}") not in taken)

    def list(self, after: tuple[float, str] | None = None, limit: int | None = None, newest: bool = False) -> list[dict]:
        """Deployments in creation order (``newest``: newest first): every one, or the first ``limit``
        past ``after``, the (created_at, deployment_id) of the last one of the page before."""
        return [_row(r) for r in key_page(self.store.db, "SELECT * FROM deployments", ("created_at", "deployment_id"),
                                          after, limit, newest)]

    def count(self) -> int:
        return row_count(self.store.db, "deployments")

    def mark_sent(self, deployment_id: str, devices: list[str], sent: str) -> tuple[int, dict[str, float | None]]:
        """Record that ``devices`` are sent ``sent`` of this deployment; returns the assignment's
        sequence: above every one sent before, and never below the wall clock in milliseconds, so
        even a store restored from an older backup numbers its next assignment above what devices hold;
        and each device's enrolment it was sent to (``devices.enrolled_at``, read in the same transaction)."""
        now = time.time()
        with self.store._tx() as db:
            (high,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM deployment_assignments").fetchone()
            seq = max(high + 1, int(now * 1000))
            enrolments = {**dict.fromkeys(devices), **enrolments_of(db, devices)}
            # a run after a rollback (a device let go, then back in the stage), or to another enrolment of
            # the id (revoked, enrolled again: a new device), is judged anew: its old report goes
            db.executemany("INSERT INTO deployment_devices (deployment_id, device, sent, sent_at, report, enrolled_at) "
                           "VALUES (?, ?, ?, ?, NULL, ?) ON CONFLICT (deployment_id, device) DO UPDATE SET "
                           "sent=excluded.sent, sent_at=excluded.sent_at, report=CASE WHEN excluded.sent = 'run' AND "
                           "(deployment_devices.sent != 'run' OR deployment_devices.enrolled_at IS NOT "
                           "excluded.enrolled_at) THEN NULL ELSE report END, enrolled_at=excluded.enrolled_at",
                           [(deployment_id, d, sent, now, enrolments[d]) for d in devices])
            db.executemany("INSERT OR REPLACE INTO deployment_assignments VALUES (?, ?, ?, ?)",
                           [(d, deployment_id, seq, sent) for d in devices])
        return seq, enrolments

    def last_assignments(self) -> dict[str, tuple[str, int]]:
        """device -> (deployment, seq) of the last assignment sent to it."""
        return {r[0]: (r[1], r[2]) for r in self.store.db.execute(
            "SELECT device, deployment_id, seq FROM deployment_assignments")}

    def add_counts(self, counts: dict[tuple[str, str], int]) -> None:
        """Add to the (deployment, name) counters."""
        with self.store._tx() as db:
            db.executemany("INSERT INTO deployment_counters VALUES (?, ?, ?) ON CONFLICT (deployment_id, name) "
                           "DO UPDATE SET value = value + excluded.value",
                           [(dep, name, n) for (dep, name), n in counts.items()])

    def counters(self, deployment_id: str) -> dict[str, int]:
        return dict(self.store.db.execute("SELECT name, value FROM deployment_counters WHERE deployment_id=? "
                                          "ORDER BY name", (deployment_id,)).fetchall())

    def record_report(self, deployment_id: str, device: str, report: dict) -> None:
        with self.store._tx() as db:
            db.execute("UPDATE deployment_devices SET report=? WHERE deployment_id=? AND device=?",
                       (json.dumps(report), deployment_id, device))

    def reported_sizes(self, exclude: str = "") -> dict[str, int]:
        """device -> the smallest held-out size it reported in any deployment but ``exclude``."""
        out: dict[str, int] = {}
        for device, report in self.store.db.execute("SELECT device, report FROM deployment_devices WHERE "
                                                    "report IS NOT NULL AND deployment_id != ?", (exclude,)):
            n = json.loads(report).get("n")
            if isinstance(n, int) and n > 0:
                out[device] = min(n, out.get(device, n))
        return out

    def devices(self, deployment_id: str) -> dict[str, dict]:
        """device -> {sent, sent_at, enrolled_at, report} (enrolled_at: the enrolment it was sent to)."""
        return {r["device"]: {"sent": r["sent"], "sent_at": r["sent_at"], "enrolled_at": r["enrolled_at"],
                              "report": json.loads(r["report"]) if r["report"] else None}
                for r in self.store.db.execute("SELECT * FROM deployment_devices WHERE deployment_id=? "
                                               "ORDER BY device", (deployment_id,))}


def _row(r) -> dict:
    return {"deployment_id": r["deployment_id"], "model_id": r["model_id"], "state": r["state"],
            "spec": json.loads(r["spec"]), "created_at": r["created_at"], "updated_at": r["updated_at"]}
