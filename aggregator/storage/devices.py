"""The fleet as the store knows it: devices (enrolment with an Ed25519 public key and an MQTT
password hash, enrolled or revoked; presence: last seen, online, profile; the tags the operator
gave them, ``device_tags``) and the named groups clustered jobs put them in (``clusters``,
``devices.cluster``)."""

from __future__ import annotations

import json
import sqlite3
import time

from aggregator.storage.connection import StoreConnection, StoreError


class DeviceRepository(StoreConnection):
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

    def devices(self, after: str = "", limit: int | None = None, status: str | None = None) -> list[dict]:
        """Devices in id order: every one, or a page (the first ``limit`` with an id after ``after``),
        of one ``status`` or any."""
        sql, args = f"{_WITH_TAGS} WHERE d.device_id > ?", [after]
        if status is not None:
            sql, args = sql + " AND d.status = ?", args + [status]
        sql += " ORDER BY d.device_id"
        if limit is not None:
            sql, args = sql + " LIMIT ?", args + [limit]
        return [_device_row(r) for r in self.db.execute(sql, args)]

    def online_count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM devices WHERE online = 1").fetchone()[0]

    def device_counts(self) -> dict[str, int]:
        """status -> how many devices have it."""
        return {r[0]: r[1] for r in self.db.execute("SELECT status, COUNT(*) FROM devices GROUP BY status")}

    def unknown_devices(self, device_ids: list[str]) -> set[str]:
        """Which of ``device_ids`` the store has no row for."""
        return set(device_ids) - set(enrolments(self.db, device_ids))

    def device(self, device_id: str) -> dict | None:
        r = self.db.execute(f"{_WITH_TAGS} WHERE d.device_id=?", (device_id,)).fetchone()
        return _device_row(r) if r else None

    def set_device_tags(self, device_id: str, tags: list[str]) -> None:
        """The operator's tags of a known device (replacing any it had; [] clears them); KeyError
        for a device the store does not know."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM devices WHERE device_id=?", (device_id,)).fetchone() is None:
                raise KeyError(device_id)
            if tags:
                db.execute("INSERT INTO device_tags VALUES (?, ?) "
                           "ON CONFLICT(device_id) DO UPDATE SET tags=excluded.tags", (device_id, json.dumps(sorted(set(tags)))))
            else:
                db.execute("DELETE FROM device_tags WHERE device_id=?", (device_id,))

    def operator_fleet(self) -> tuple[dict[str, tuple[tuple[str, ...], float | None]], int]:
        """Known, not revoked devices -> (the tags the operator gave them, their enrolment); and a
        change seq (``fleet_changes``) these rows include every change up to: a change after it has a
        higher one (:meth:`fleet_changes_after`). The seq is read first: a change committed between
        the two reads is in the rows and read again later, never missed."""
        high = self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM fleet_changes").fetchone()[0]
        rows = self.db.execute(f"{FLEET_READ} FROM devices d LEFT JOIN device_tags t USING (device_id) "
                               "WHERE d.status != 'revoked'")
        return {r["device_id"]: _fleet_member(r) for r in rows}, high

    def fleet_changes_after(self, seq: int) -> tuple[dict[str, tuple[tuple[str, ...], float | None] | None], int]:
        """The devices whose place in the fleet changed after change ``seq`` -> (their tags, their
        enrolment) now, or None when they are no longer in it (revoked, deleted); and the highest seq
        read (``seq`` when nothing changed: one indexed look-up)."""
        changed, high = {}, seq
        for r in self.db.execute(f"{FLEET_READ}, c.device_id AS changed, c.seq FROM fleet_changes c "
                                 "LEFT JOIN devices d USING (device_id) LEFT JOIN device_tags t USING (device_id) "
                                 "WHERE c.seq > ?", (seq,)):
            high = max(high, r["seq"])
            in_fleet = r["status"] is not None and r["status"] != "revoked"
            changed[r["changed"]] = _fleet_member(r) if in_fleet else None
        return changed, high

    def enrolled_keys(self) -> dict[str, bytes | None]:
        """Active devices -> raw Ed25519 public key (None for devices enrolled without one)."""
        return {r["device_id"]: (bytes(r["public_key"]) if r["public_key"] is not None else None)
                for r in self.db.execute("SELECT device_id, public_key FROM devices WHERE status='enrolled'")}

    def password_hashes(self) -> dict[str, str]:
        return {r["device_id"]: r["mqtt_password_hash"] for r in self.db.execute(
            "SELECT device_id, mqtt_password_hash FROM devices WHERE status='enrolled' "
            "AND mqtt_password_hash IS NOT NULL ORDER BY device_id")}

    # ------------------------------------------------------------------ clusters
    def set_cluster(self, device_id: str, cluster_id: str | None) -> None:
        with self._tx() as db:
            db.execute("UPDATE devices SET cluster=? WHERE device_id=?", (cluster_id, device_id))

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


def enrolments(db: sqlite3.Connection, device_ids: list[str]) -> dict[str, float | None]:
    """Each of ``device_ids`` the store has a row for -> its enrolment (``enrolled_at``: a revoked id
    enrolled again has another), read on ``db`` (the caller's transaction, where it writes by it)."""
    found: dict[str, float | None] = {}
    for start in range(0, len(device_ids), 500):            # SQLite's bound-parameter limit
        batch = device_ids[start:start + 500]
        found.update(db.execute(f"SELECT device_id, enrolled_at FROM devices WHERE device_id IN "
                                f"({','.join('?' * len(batch))})", batch).fetchall())
    return found


# what a deployment reads of a device: whether it is in the fleet, its operator tags (its cohort's), its
# enrolment (a revoked id enrolled again changes it: a new device, whose predecessor's report is not its own)
FLEET_READ = "SELECT d.device_id, d.status, d.enrolled_at, t.tags"
_WITH_TAGS = "SELECT d.*, t.tags AS operator_tags FROM devices d LEFT JOIN device_tags t USING (device_id)"


def _fleet_member(r: sqlite3.Row) -> tuple[tuple[str, ...], float | None]:
    return tuple(json.loads(r["tags"] or "[]")), r["enrolled_at"]


def _device_row(r: sqlite3.Row) -> dict:
    return {"device_id": r["device_id"], "status": r["status"],
            "public_key": bytes(r["public_key"]).hex() if r["public_key"] is not None else None,
            "enrolled_at": r["enrolled_at"], "revoked_at": r["revoked_at"], "last_seen": r["last_seen"],
            "online": bool(r["online"]), "profile": json.loads(r["profile"] or "{}"), "cluster": r["cluster"],
            "tags": json.loads(r["operator_tags"] or "[]")}
