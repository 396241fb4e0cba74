"""An operator's cancel of the job the service is serving outlives the service: it is stored
(``cancelling``) at once, and a service restarted before the job's open round closed ends the job
cancelled once its restored round closes, as the one cancelled would have. It used to live in the
serving process only (``ActiveJob.cancelling``): a crash after the cancel resumed the job running,
and a rebuild of the served job (``AggregatorService._job_broken``) forgot it.

Against a real SQLite store and a real mosquitto; the crash is a SIGKILL of an aggregator process
(``FEDFLEET_CRASH_AT``, as tests/test_crash_resume_kinds.py's), restarted on its state file alone.
The cancelled job's statistics are checked against an independent numpy sum of the devices that
contributed before the cancel (``ops_fleet.reference_sums``).
"""

from __future__ import annotations

import http.client
import json
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.jobs.registry import build_job
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.schema import JobState
from aggregator.storage.store import Store
from protocols.mqtt_link import BrokerConfig

from ops_fleet import Fleet, job_config, reference_sums, wait_for
from test_crash_resume_kinds import TOKEN, AggregatorProcess, post

pytestmark = pytest.mark.slow       # aggregator processes killed and restarted

DEVICES = [f"dev{i:02d}" for i in range(4)]


def stored(state: Path, sql: str) -> list[tuple]:
    db = sqlite3.connect(state)         # another process's store, read only here
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def test_a_job_cancelled_before_a_sigkill_ends_cancelled_after_the_restart(broker, tmp_path):
    work = tmp_path / "run"
    work.mkdir()
    (work / "enrolled.txt").write_text("\n".join(DEVICES) + "\n")
    (work / "token").write_text(TOKEN)
    state = work / "state.db"
    gates = {d: threading.Event() for d in DEVICES}         # no device answers until let go
    config = {k: v for k, v in job_config(DEVICES).items() if k != "job_id"}
    first = restarted = None
    try:
        with Fleet(broker.url, DEVICES, gates=gates):
            # killed at the close that the cancel brings about, before it is committed
            first = AggregatorProcess(work, broker.url, "round_closing", "--keep-serving", "--api", "127.0.0.1:0",
                                      "--api-token-file", str(work / "token"))
            api = first.api_url()
            post(f"{api}/api/jobs", {"job_id": "job", "kind": "fed3r", "config": config})
            post(f"{api}/api/jobs/job/start")
            wait_for(lambda: stored(state, "SELECT 1 FROM rounds"), 60, "round 1 to open")
            participants = json.loads(stored(state, "SELECT participants FROM rounds WHERE round=1")[0][0])
            answered = participants[0]
            gates[answered].set()                       # one participant answers; the others are still working
            wait_for(lambda: stored(state, "SELECT device FROM contributions"), 60, "its contribution")

            try:
                answer = post(f"{api}/api/jobs/job/cancel")
            except (http.client.HTTPException, OSError):
                answer = None       # the tick right after the cancel may kill the process before it answers
            rc, log = first.wait(60)
            assert rc == -9 and "crash point round_closing reached" in log, log[-3000:]
            assert answer is None or answer["state"] == "cancelling"
            assert stored(state, "SELECT state FROM jobs") == [("cancelling",)]       # it was left "running"
            assert stored(state, "SELECT state FROM rounds") == [("open",)]    # its close was not committed

            # restarted from the store alone, the others still working: it ends without them (it
            # resumed the job running, waiting for them)
            restarted = AggregatorProcess(work, broker.url, None)
            rc, log = restarted.wait(60)
    finally:
        for gate in gates.values():
            gate.set()
        for run in (first, restarted):
            if run is not None and run.proc.poll() is None:
                run.proc.kill()
    assert rc == 1 and '"state": "cancelled"' in log, log[-3000:]       # its exit status: the job is not done
    assert "job job restored: 1 rounds" in log
    assert stored(state, "SELECT state FROM jobs") == [("cancelled",)]
    outcome = json.loads(stored(state, "SELECT outcome FROM rounds WHERE round=1 AND state='closed'")[0][0])
    assert outcome["accepted"] == [answered] and sorted(outcome["dropped"]) == sorted(set(participants) - {answered})
    assert stored(state, "SELECT round FROM rounds") == [(1,)]             # no round opened after the cancel
    assert stored(state, "SELECT device FROM contributions") == [(answered,)]
    results = json.loads((work / "out" / "job" / "results.json").read_text())
    assert results["state"] == "cancelled" and sorted(results["contributed"]) == [answered]
    stats = dict(np.load(work / "out" / "job" / "statistics.npz"))
    A_ref, B_ref = reference_sums([answered])
    np.testing.assert_allclose(stats["A"], A_ref, rtol=1e-12)
    np.testing.assert_allclose(stats["B"], B_ref, rtol=1e-12)


def serve_until(svc: AggregatorService, done, turns: int = 200) -> None:
    for _ in range(turns):
        svc.loop.serve_one()
        if done():
            return
    raise AssertionError("the service never got there")


def service(store: Store, broker, out: Path, job: Fed3RJob | None) -> AggregatorService:
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), out, ServiceSettings(tick_s=0.01),
                            enrolled={"d0", "d1"}, store=store)
    for device in ("d0", "d1"):
        svc.fleet.presence(device, True, {})
    return svc


def cancelled_mid_round(store: Store, broker, out: Path) -> AggregatorService:
    """A service whose job has round 1 open (no device answers here), then cancelled by the operator."""
    cfg = Fed3RConfig(job_id="c", num_classes=3, feature_dim=4, clients_per_round=2, expected_devices=2,
                      start_timeout_s=0, round_timeout_s=600)
    svc = service(store, broker, out, Fed3RJob(cfg))
    serve_until(svc, lambda: svc.active.current is not None)
    assert svc.control_job("c", "cancel")["state"] == JobState.CANCELLING
    assert store.job("c")["state"] == JobState.CANCELLING
    return svc


def assert_ended_cancelled(svc: AggregatorService, store: Store) -> None:
    serve_until(svc, lambda: svc.active.final_state)        # its round (deadline in 10 min) closes at once
    assert svc.active.final_state == JobState.CANCELLED
    assert svc._finish_job()["state"] == JobState.CANCELLED
    assert store.job("c")["state"] == JobState.CANCELLED
    assert [(r.round, r.state) for r in store.rounds("c")] == [(1, "closed")]


def test_a_served_job_rebuilt_after_its_cancel_stays_cancelling(broker, tmp_path):
    store = Store(tmp_path / "state.db")
    try:
        svc = cancelled_mid_round(store, broker, tmp_path / "out")
        before = svc.active
        svc._job_broken("a device forgotten")           # rebuilt from the store
        assert svc.active is not before and svc.active.cancelling
        svc._update_live(force=True)
        assert svc.live["job"]["state"] == "cancelling"                # what the admin API's status shows
        assert_ended_cancelled(svc, store)
    finally:
        store.close()


def test_a_service_started_again_takes_a_cancelling_job_up_before_a_queued_one(broker, tmp_path):
    store = Store(tmp_path / "state.db")
    try:
        crashed = cancelled_mid_round(store, broker, tmp_path / "out")
        crashed.writer.close()                                # its process is gone; its store remains
        store.create_job("later", "fed3r", {**crashed.active.job.config.to_dict(), "job_id": "later"},
                         state=JobState.QUEUED)
        svc = service(store, broker, tmp_path / "out", None)     # `aggregator serve --state` with no job
        assert svc._start_next_job() and svc.active.job_id == "c" and svc.active.cancelling
        assert_ended_cancelled(svc, store)
        assert store.job("later")["state"] == JobState.QUEUED
    finally:
        store.close()


def test_a_cancelling_job_that_cannot_be_built_again_ends_cancelled_saying_why(tmp_path):
    """A cancelling job whose input file is gone by the restart (a FedAvg job started from a Fed3R
    head) cannot be built: the operator's cancel stands, so it ends cancelled with the reason, not
    stopped (which a start would take up again); a running one in the same plight stops."""
    head = tmp_path / "head.npz"
    np.savez(head, coef=np.zeros((3, 4)), intercept=np.zeros(3))
    store = Store(tmp_path / "state.db")
    try:
        for job_id, state in (("c", JobState.CANCELLING), ("r", JobState.RUNNING)):
            store.create_job(job_id, "fedavg", {"job_id": job_id, "num_classes": 3, "feature_dim": 4, "init": "fed3r",
                                                "initial_head_file": str(head)}, state=state)
        head.unlink()
        svc = AggregatorService(None, BrokerConfig.from_url("mqtt://127.0.0.1:1"), tmp_path / "out",
                                ServiceSettings(), store=store)
        assert not svc._start_next_job() and not svc._start_next_job()
        ended = {job_id: store.job(job_id) for job_id in ("c", "r")}
        assert ended["c"]["state"] == JobState.CANCELLED and ended["c"]["finished_at"] is not None
        assert ended["r"]["state"] == JobState.STOPPED
        assert all("head.npz" in row["summary"]["error"] for row in ended.values()), ended
    finally:
        store.close()


@pytest.mark.parametrize("cancelled", [True, False])
def test_a_served_job_that_cannot_be_rebuilt_ends_as_a_restart_would_end_it(broker, tmp_path, cancelled):
    """The served job must be rebuilt from the store (a device forgotten), but its input file is
    gone: a cancelling one ends cancelled with the reason, as it does at a restart
    (``GivenUp``): the operator's cancel stands, and its end reports its record only, no model
    made from the state it was given up in (the old code stopped it, which a start would take up
    again, and wrote its model's files); a running one stops, as before."""
    head = tmp_path / "head.npz"
    np.savez(head, coef=np.ones((3, 4)), intercept=np.zeros(3))
    store = Store(tmp_path / "state.db")
    try:
        job = build_job("fedavg", {"job_id": "c", "num_classes": 3, "feature_dim": 4, "init": "fed3r",
                                   "initial_head_file": str(head), "clients_per_round": 2, "expected_devices": 2,
                                   "start_timeout_s": 0, "round_timeout_s": 600})
        svc = service(store, broker, tmp_path / "out", job)
        serve_until(svc, lambda: svc.active.current is not None)
        if cancelled:
            assert svc.control_job("c", "cancel")["state"] == JobState.CANCELLING
        a = svc.active
        head.unlink()
        svc._job_broken("device d1 forgotten")
        assert svc.active is a                          # not rebuilt
        row = store.job("c")
        assert "device d1 forgotten, and it cannot be rebuilt" in row["summary"]["error"]
        assert "head.npz" in row["summary"]["error"]
        if not cancelled:
            assert row["state"] == a.final_state == JobState.STOPPED
            return
        assert row["state"] == a.final_state == JobState.CANCELLED and row["finished_at"] is not None
        svc._update_live(force=True)
        assert svc.live["job"]["state"] == "cancelled"                 # what the admin API's status shows
        summary = svc._finish_job()
        assert summary["state"] == JobState.CANCELLED and summary["error"] == row["summary"]["error"]
        assert store.job("c")["state"] == JobState.CANCELLED
        assert not any(m["final"] for m in store.models("c"))
        # its record is complete, as a job cancelled after its round's close stores it: the counters
        # and the compact summary (the returned one less its round log and history), the reason kept
        # (the store was set cancelled before the end, and the end used to skip writing them)
        record = store.job("c")
        assert record["counters"] == a.stats.to_dict() and record["counters"]
        assert record["summary"] == {k: v for k, v in summary.items() if k not in ("history", "rounds", "finished_at")}
        out = tmp_path / "out"
        saved = json.loads((out / "results.json").read_text())
        assert saved["state"] == "cancelled" and saved["error"] == row["summary"]["error"]
        assert not (out / "model.npz").exists() and not (out / "statistics.npz").exists()
    finally:
        store.close()


def test_a_cancelling_stateful_job_that_cannot_be_built_tells_its_devices_it_ended(tmp_path):
    """A cancelling Ditto job (its devices keep v_k under its run) that cannot be built again at a
    start ends cancelled (GivenUp) and, as a cancel of a job not served does, adds its job-end
    notice with the run its last round gave its devices: they drop its state now. It ended without
    one: its devices kept the state until the next start of the service listed it
    (job_end.restored_notices)."""
    from aggregator.jobs.device_state_fields import RUN_KEY
    from protocols.payloads.job_end import JobEnded

    head = tmp_path / "head.npz"
    np.savez(head, coef=np.zeros((3, 4)), intercept=np.zeros(3))
    store = Store(tmp_path / "state.db")
    try:
        store.create_job("d", "ditto", {"job_id": "d", "num_classes": 3, "feature_dim": 4, "init": "fed3r",
                                        "initial_head_file": str(head)}, state=JobState.CANCELLING)
        store.open_round("d", 1, ["dev1"], {"dev1": "t1"}, {RUN_KEY: "0123abcd"}, 0.0)
        head.unlink()
        svc = AggregatorService(None, BrokerConfig.from_url("mqtt://127.0.0.1:1"), tmp_path / "out",
                                ServiceSettings(), store=store)
        assert not svc._start_next_job()
        assert store.job("d")["state"] == JobState.CANCELLED
        assert svc.job_ends.notices == [JobEnded("d", "0123abcd", "cancelled")]
    finally:
        store.close()
