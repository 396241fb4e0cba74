"""Why a job no device contributed to failed (aggregator/service/job_outcome.py): in the devices'
own words, over every round of the job, though the service keeps only its latest rounds in memory
(jobs/recent_log.py): the store has them all."""

from aggregator.jobs.registry import build_job
from aggregator.service.active_job import ActiveJob
from aggregator.service.job_outcome import judged_state
from aggregator.storage.schema import JobState
from aggregator.storage.store import Store

DEADLINE = "dropped: no answer before the round's deadline"


def failed_job(tmp_path, monkeypatch, store: Store | None) -> ActiveJob:
    """Five closed rounds, no contribution: devA dropped in round 1, devB in rounds 2-5, devC
    declined in round 2 and dropped in round 3; the service keeps the latest 3 rounds."""
    monkeypatch.setattr("aggregator.jobs.recent_log.KEPT", 3)
    cfg = {"job_id": "quiet", "num_classes": 3, "feature_dim": 8, "clients_per_round": 3, "rounds": 5}
    a = ActiveJob(build_job("fedavg", cfg), "fedavg", tmp_path)
    if store is not None:
        store.create_job("quiet", "fedavg", cfg, state=JobState.RUNNING)
    for r in range(1, 6):
        dropped = ["devA"] if r == 1 else ["devB", "devC"] if r == 3 else ["devB"]
        outcome = {"round": r, "accepted": [], "dropped": dropped, "declined": ["devC"] * (r == 2), "rejected": []}
        a.round_log.append(outcome)
        if store is not None:
            store.open_round("quiet", r, ["devA", "devB", "devC"], {}, {}, 0.0)
            if r == 2:
                store.add_round_event("quiet", r, "devC", "declined", "no camera")
            store.close_round("quiet", r, outcome)
    a.job.round = 5
    assert len(a.round_log) == 3 and a.round_log.earlier == 2
    return a


def test_a_failed_jobs_reason_names_every_silent_device_from_the_store(tmp_path, monkeypatch):
    store = Store(tmp_path / "state.db")
    state, why = judged_state(failed_job(tmp_path, monkeypatch, store), store)
    assert state == JobState.FAILED
    assert f"{DEADLINE} (devA, devB)" in why and "declined: no camera (devC)" in why


def test_without_a_store_the_reason_reads_the_rounds_kept_in_memory(tmp_path, monkeypatch):
    state, why = judged_state(failed_job(tmp_path, monkeypatch, None), None)
    assert state == JobState.FAILED and f"{DEADLINE} (devB, devC)" in why and "devA" not in why
