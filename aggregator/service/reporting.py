"""What the service tells the outside about its job: the live snapshot the admin API reads, the
retained ``status`` message devices and dashboards see, and the files a finished job leaves
(``results.json``, ``model.npz``, ``statistics.npz``) with its summary. Pure functions of the
service's state; the service decides when they run.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from aggregator.compute.privacy import published_state
from aggregator.service.active_job import ActiveJob
from aggregator.security.fleet import Fleet
from aggregator.storage.schema import JobState


class Pacing:
    """When to retake the live snapshot: at most every ``every_s``, and at most once per
    ``cost_factor`` times what the last one took. Why: the snapshot sorts the online fleet, O(N log
    N): 31 ms with 100,000 online, 16 % of the service thread when retaken every 0.2 s
    (``bench/service_hot_paths.py``). Spaced to 20x its own cost it stays within 5 % of the thread
    at any fleet size."""

    def __init__(self, every_s: float = 0.2, cost_factor: float = 20.0):
        self.every_s, self.cost_factor = every_s, cost_factor
        self._next = 0.0

    def due(self) -> bool:
        return time.monotonic() >= self._next

    @contextmanager
    def timed(self):
        started = time.monotonic()
        yield
        self._next = started + max(self.every_s, self.cost_factor * (time.monotonic() - started))


def live_snapshot(a: ActiveJob | None, fleet: Fleet, stats: dict) -> dict:
    """The admin API's view of the service (replaced atomically, read from other threads)."""
    snap: dict = {"time": time.time(), "devices_online": sorted(fleet.online), "revoked": sorted(fleet.revoked),
                  "not_enrolled": sorted(fleet.online_not_enrolled()),
                  "fleet_mode": fleet.mode, "last_seen": dict(fleet.last_seen), "job": None, "stats": stats}
    if a is None:
        return snap
    coord = a.current
    current = None
    if coord is not None:
        current = {**coord.snapshot(), "opened_at": a.opened_at.get(coord.round),
                   "deadline": a.deadlines.get(coord.round), "bytes_in": a.round_bytes[coord.round]}
        del current["state"]
    snap["job"] = {"job_id": a.job_id, "kind": a.kind, "state": a.shown_state, "round": a.job.round,
                   "contributions": a.job.contributions,
                   "accuracy": a.history[-1].get("accuracy") if a.history else None,
                   "privacy": a.history[-1].get("privacy") if a.history else None,
                   "stats": a.stats.to_dict(), "current_round": current,
                   # devices not asked again: their decline said their clock runs ahead (a count: bounded)
                   "clock_ahead": len(a.clock_ahead),
                   # why no round opens (a DP pool too small, ...): while it could open one only
                   "waiting": a.job.waiting if coord is None and a.shown_state == JobState.RUNNING else None}
    return snap


# the round's lists of devices, answered as their counts by /api/status (``status_summary``)
ROUND_DEVICE_LISTS = ("participants", "accepted", "declined", "rejected", "lost", "pending")


def status_summary(snap: dict) -> dict:
    """What ``GET /api/status`` answers of a live snapshot: its size bounded whatever the fleet's.
    The snapshot lists every online, revoked and stranger device and a last-seen time per device
    (4 MB at 100,000 online, polled each second by the dashboard); here each list of devices is its
    count, under its own key, and the last-seen map is left out. Per-device rows are the paginated
    ``/api/devices``'s, a round's devices ``/api/jobs/{id}/rounds``'s. An empty snapshot (no
    service) stays empty."""
    if not snap:
        return {}
    summary = {**snap, "devices_online": len(snap["devices_online"]), "revoked": len(snap["revoked"]),
               "not_enrolled": len(snap["not_enrolled"])}
    summary.pop("last_seen", None)
    job = snap["job"]
    if job is not None and job["current_round"] is not None:
        current = job["current_round"]
        summary["job"] = {**job, "current_round": {**current, **{k: len(current[k]) for k in ROUND_DEVICE_LISTS if k in current}}}
    return summary


def status_body(a: ActiveJob, online: int, known: int, state: str | None = None) -> dict:
    """The body of the retained ``status`` message."""
    last = a.history[-1] if a.history else {}
    return {"state": state or a.shown_state, "job": a.job_id, "round": a.job.round,
            "contributions": a.job.contributions, "devices_online": online, "devices_known": known,
            "accuracy": last.get("accuracy"), "privacy": last.get("privacy"), "bytes_in": a.stats.bytes_in}


def job_summary(a: ActiveJob, state: str, final_eval: dict, bytes_out: int) -> dict:
    """``results.json``: the config, who contributed, the round log, the evaluations, the counters."""
    return {
        "state": state,
        "job_id": a.job_id,
        "config": a.job.config.to_dict(),
        "contributed": a.job.contributed,
        "rounds": list(a.round_log),            # the latest rounds (jobs/recent_log.py); the rest are
        "rounds_earlier": a.round_log.earlier,  # in the store and rounds.jsonl
        "history": list(a.history),
        "history_earlier": a.history.earlier,
        "final": final_eval,
        "bytes_in": a.stats.bytes_in,
        "bytes_out": bytes_out,
        "results_accepted": a.job.contributions,
        "rejections": dict(a.stats.rejections),
        "late": a.stats.late,
        "duplicates": a.stats.duplicates,
        "clock_ahead": sorted(a.clock_ahead.rounds),     # not asked again: their decline said their clock runs ahead
        "wall_s": time.time() - a.started_at,
    }


def write_job_files(out_dir: Path, final_job, summary: dict) -> None:
    """The job's files; ``final_job`` None: its end failed, and nothing made from its state (which
    that end may have left half made: a draw, a failed solve) is published, only its record."""
    if final_job is not None:
        if not final_job.model_held:        # a stopped job that releases its model at the end has none yet
            np.savez(out_dir / "model.npz", **final_job.model_arrays())
        np.savez(out_dir / "statistics.npz", **published_state(final_job.state_dict()))
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1))
