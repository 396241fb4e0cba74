"""The durable store and the service's restore path, driven without a network.

The service's MQTT link is never started here: messages are fed to its inbound handler and the
clock is ticked by hand (publishes are queued by paho and never sent), so each step of a round
and each "crash" (dropping the service object and building a new one on the same state file) is
deterministic.
"""

import math
import sqlite3
import time

import numpy as np
import pytest

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.jobs.registry import validate_job_config
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.schema import SCHEMA_VERSION
from aggregator.storage.store import Store, StoreError, arrays_sha256
from protocols import messages as M
from protocols.envelope import encode
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

from ops_fleet import SyntheticStats, job_config, reference_sums

DEVICES = ["dev01", "dev02", "dev03", "dev04"]
T = Topics()


def make_service(tmp_path, checkpoints=True, **cfg_over):
    cfg = Fed3RConfig(**job_config(DEVICES, **{"clients_per_round": 2, **cfg_over}))
    return AggregatorService(Fed3RJob(cfg), BrokerConfig(port=1), tmp_path / "out",
                             ServiceSettings(checkpoints=checkpoints), enrolled=set(DEVICES),
                             store=Store(tmp_path / "state.db"))


def presence(svc, device, state="online"):
    svc._on_payload(T.presence(device), encode(M.presence_message(device, state, {"slowdown": 1.5})))


def result_for(svc, device, round_=1):
    task = svc.store.rounds("ops")[round_ - 1].tasks.get(device, "0" * 32)
    body, tensors = SyntheticStats(device)({})
    return M.result_message(device, M.TaskRef("ops", round_, task), "fed3r.stats", body, tensors)


def send(svc, device, env):
    svc._on_payload(T.outbox(device), encode(env))


def open_first_round(svc):
    for d in DEVICES:
        presence(svc, d)
    svc._tick(time.monotonic())
    rounds = svc.store.rounds("ops")
    assert len(rounds) == 1 and len(rounds[0].participants) == 2
    return list(rounds[0].participants)


def test_store_records_devices_jobs_rounds_models_and_refuses_duplicates(tmp_path):
    store = Store(tmp_path / "s.db")
    db = sqlite3.connect(tmp_path / "s.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2          # FULL: durable at commit
    store.enroll_device("dev01", b"k" * 32, "$7$hash")
    with pytest.raises(StoreError, match="already enrolled"):
        store.enroll_device("dev01", b"k" * 32, "$7$hash")
    store.revoke_device("dev01")
    assert store.device("dev01")["status"] == "revoked" and store.password_hashes() == {}
    with pytest.raises(StoreError):
        store.revoke_device("dev01")
    store.enroll_device("dev01", b"j" * 32, "$7$new")                         # re-enrolment after revocation
    assert store.enrolled_keys() == {"dev01": b"j" * 32}
    store.create_job("j1", "fed3r", {"a": 1})
    with pytest.raises(StoreError, match="exists"):
        store.create_job("j1", "fed3r", {"a": 1})
    store.open_round("j1", 1, ["dev01"], {"dev01": "t1"}, {"round": 1}, time.time() + 5)
    store.add_contribution("j1", 1, "dev01", "m1", b"payload")
    for dup in (("j1", 1, "dev01", "m1", b"x"), ("j1", 1, "dev01", "m2", b"x")):   # same id / same device+round
        with pytest.raises(StoreError, match="already stored"):
            store.add_contribution(*dup)
    arrays = {"coef": np.arange(6.0).reshape(2, 3)}
    m1 = store.close_round("j1", 1, {"accepted": ["dev01"]}, arrays, {"accuracy": 0.5})
    with pytest.raises(StoreError, match="not open"):
        store.close_round("j1", 1, {}, arrays)
    store.open_round("j1", 2, ["dev01"], {}, {"round": 2}, time.time())
    m2 = store.close_round("j1", 2, {"accepted": []}, {"coef": arrays["coef"] * 2}, {})
    lineage = store.lineage(m2)
    assert [m["model_id"] for m in lineage] == [m2, m1] and lineage[1]["accepted"] == ["dev01"]
    assert store.model(m1)["sha256"] == arrays_sha256(arrays) != store.model(m2)["sha256"]
    with np.load(__import__("io").BytesIO(store.model_bytes(m1))) as z:
        assert np.array_equal(z["coef"], arrays["coef"])
    store.upsert_cluster("c1", "north", "j1", m2)
    store.set_cluster("dev01", "c1")
    assert store.clusters()[0]["devices"] == 1


def test_restart_replays_bit_identically_and_answers_redeliveries_as_duplicates(tmp_path):
    svc = make_service(tmp_path)
    first, second = open_first_round(svc)
    accepted = result_for(svc, first)
    send(svc, first, accepted)
    assert svc.job.contributions == 1
    before_A, before_book = svc.job.strategy.A.clone(), svc.job.bookkeeping()

    restarted = make_service(tmp_path)                    # the first service "crashed": dropped unflushed
    assert np.array_equal(restarted.job.strategy.A.cpu().numpy(), before_A.cpu().numpy())
    assert restarted.job.bookkeeping() == before_book and restarted.job.contributed == {first: 25}
    send(restarted, first, accepted)                      # QoS 1 redelivery / device retry of the same id
    assert restarted.active.stats.duplicates == 1 and restarted.job.contributions == 1
    other = next(d for d in DEVICES if d not in (first, second))
    send(restarted, other, result_for(restarted, other))  # not selected for this round
    assert restarted.job.contributions == 1
    send(restarted, second, result_for(restarted, second))
    restarted._tick(time.monotonic())
    rounds = restarted.store.rounds("ops")
    assert rounds[0].state == "closed" and sorted(rounds[0].outcome["accepted"]) == sorted([first, second])
    A_ref, _ = reference_sums([first, second])
    np.testing.assert_allclose(restarted.job.strategy.A.cpu().numpy(), A_ref, rtol=1e-12)
    assert len(restarted.store.models("ops")) == 1

    from_checkpoint, replayed = make_service(tmp_path), make_service(tmp_path, checkpoints=False)
    assert np.array_equal(from_checkpoint.job.strategy.A.cpu().numpy(), replayed.job.strategy.A.cpu().numpy())
    assert np.array_equal(from_checkpoint.job.strategy.A.cpu().numpy(), restarted.job.strategy.A.cpu().numpy())
    assert from_checkpoint.job.contributed == replayed.job.contributed == restarted.job.contributed

    again = make_service(tmp_path)                        # closed round: old ids duplicate, new ones late
    dups, late = again.active.stats.duplicates, again.active.stats.late   # counters survive restarts
    assert dups == 1
    send(again, first, accepted)
    send(again, second, result_for(again, second))
    assert again.active.stats.duplicates == dups + 1 and again.active.stats.late == late + 1
    assert again.job.contributions == 2 and len(list(again.store.contributions("ops"))) == 2


def test_restored_round_keeps_declines_and_its_deadline(tmp_path):
    svc = make_service(tmp_path, round_timeout_s=0.5)
    first, second = open_first_round(svc)
    send(svc, first, M.decline_message(first, M.TaskRef("ops", 1, svc.store.rounds("ops")[0].tasks[first]), "busy"))
    restarted = make_service(tmp_path, round_timeout_s=0.5)
    assert restarted.active.current.declined == {first: "busy"}
    time.sleep(0.6)
    restarted._tick(time.monotonic())                     # the stored deadline has passed
    outcome = restarted.store.rounds("ops")[0].outcome
    assert outcome["declined"] == [first] and outcome["dropped"] == [second] and outcome["accepted"] == []


def test_final_model_does_not_depend_on_arrival_order(tmp_path):
    finals = []
    for order in (0, 1):
        work = tmp_path / f"run{order}"
        svc = make_service(work, clients_per_round=4, max_attempts=1)
        for d in DEVICES:
            presence(svc, d)
        svc._tick(time.monotonic())
        devices = DEVICES if order == 0 else DEVICES[::-1]
        for d in devices:
            send(svc, d, result_for(svc, d))
        svc._tick(time.monotonic())
        svc._tick(time.monotonic())
        assert svc.active.final_state == "done"
        summary = svc._finish_job()
        assert summary["state"] == "done" and svc.store.job("ops")["state"] == "done"
        finals.append((dict(np.load(work / "out" / "model.npz")), dict(np.load(work / "out" / "statistics.npz")),
                       svc.job.strategy.A.cpu().numpy()))
    # the arrival-order sums differ in their last bits; the canonical re-sum does not
    assert not np.array_equal(finals[0][2], finals[1][2])
    for name in ("coef", "intercept", "raw_weights"):
        assert np.array_equal(finals[0][0][name], finals[1][0][name])
    A_ref, B_ref = reference_sums(DEVICES)
    np.testing.assert_allclose(finals[0][1]["A"], A_ref, rtol=1e-12)
    np.testing.assert_allclose(finals[0][1]["B"], B_ref, rtol=1e-12)


@pytest.mark.parametrize("bad, match", [
    ({"bogus": 1}, "no field"),
    ({"num_classes": "ten"}, "num_classes"),
    ({"num_classes": True}, "num_classes"),
    ({"lam": math.nan}, "lam"),
    ({"lam": 0.0}, "lam"),
    ({"b_format": "csr"}, "b_format"),
    ({"feature_dim": 10 ** 6}, "feature_dim"),
    ({"clients_per_round": -1}, "clients_per_round"),
    ({"random_features": {"seed": 1, "dim": 0, "sigma": 1.0}}, "random_features"),
    ({"random_features": {"dim": 4}}, "random_features"),
    ({"job_id": "a/b"}, "job_id"),
])
def test_job_config_validation_rejects_bad_configs(bad, match):
    with pytest.raises(ValueError, match=match):
        validate_job_config("fed3r", {**job_config(DEVICES), **bad})


def test_job_config_validation_accepts_defaults_and_full_configs():
    validate_job_config("fed3r", {})
    validate_job_config("fed3r", Fed3RConfig(random_features={"seed": 1, "dim": 64, "sigma": 2.0}).to_dict())
    with pytest.raises(ValueError, match="unknown job kind"):
        validate_job_config("fedavg-nope", {})


def test_a_jobs_end_failures_are_counted_in_its_row_and_afresh_once_it_is_queued_again(tmp_path):
    """``jobs.end_failures`` (schema version 4): a version 3 store (its jobs table made before the
    column) gains it at 0 when opened; each failed try of a job's end counts one more, kept across
    opens of the store; queued again (the operator starts a stopped job), the job counts afresh."""
    path = tmp_path / "state.db"
    Store(path).close()
    db = sqlite3.connect(path, isolation_level=None)        # the jobs table as version 3 made it
    db.executescript("BEGIN; ALTER TABLE jobs DROP COLUMN end_failures; "
                     "UPDATE meta SET value='3' WHERE key='schema_version'; "
                     "INSERT INTO jobs (job_id, kind, config, state, created_at, updated_at) "
                     "VALUES ('old', 'fed3r', '{}', 'running', 1.0, 1.0); COMMIT;")
    db.close()
    store = Store(path)
    assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    assert store.job("old")["end_failures"] == 0
    assert [store.count_end_failure("old") for _ in range(3)] == [1, 2, 3]
    store.close()
    store = Store(path)
    assert store.job("old")["end_failures"] == 3            # a restart counts on
    store.set_job_state("old", "stopped", {"error": "its input file is gone"})
    assert store.job("old")["end_failures"] == 3
    store.set_job_state("old", "queued")
    assert store.job("old")["end_failures"] == 0 and store.count_end_failure("old") == 1
    with pytest.raises(StoreError, match="no job 'nobody'"):
        store.count_end_failure("nobody")
    store.close()
