"""Crash and broker-restart recovery of a Fed3R job over a real mosquitto with real device agents.

The aggregator runs as a process of its own (``python -m aggregator serve --state ...``, forked by
tests/aggregator_forkserver.py) and SIGKILLs itself at a named crash point (``FEDFLEET_CRASH_AT``);
the test restarts it on the same state file until the job completes. The result must be bit-identical to an uninterrupted run, every
device must have contributed exactly once, and the sums must equal an independent numpy sum.
"""

import json
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.crash_points import CRASH_POINTS
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from fedfleet.emulation.broker import MosquittoBroker
from protocols.mqtt_link import BrokerConfig

from ops_fleet import (Fleet, job_config, prepare, reference_sums, run_aggregator, run_uninterrupted,
                       start_aggregator_in)

pytestmark = pytest.mark.slow  # aggregator subprocesses killed and restarted: xdist starts this file first

DEVICES = [f"dev{i:02d}" for i in range(8)]

# One crash per aggregator process, in the order the job passes them (counts are per process).
CRASHES = ["presence:3", "restored", "round_opened", "task_sent:2", "result_received", "contribution_file_written",
           "contribution_stored", "evaluation_stored", "ack_sent", "round_closing", "round_closed",
           "contribution_stored:2", "job_finishing", "job_finished"]


def load_outputs(out_dir):
    model = dict(np.load(out_dir / "model.npz"))
    stats = dict(np.load(out_dir / "statistics.npz"))
    return model, stats, json.loads((out_dir / "results.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of the same job (same subprocess entry point, fresh broker and state)."""
    return load_outputs(run_uninterrupted(tmp_path_factory.mktemp("reference"), DEVICES))


def assert_exactly_once(state_db, outputs):
    model, stats, results = outputs
    rows = sqlite3.connect(state_db).execute("SELECT device, message_id FROM contributions").fetchall()
    devices = [d for d, _ in rows]
    assert sorted(devices) == DEVICES, "each device contributes exactly once"
    assert len({m for _, m in rows}) == len(rows)
    sizes = dict(sqlite3.connect(state_db).execute("SELECT printf('%012d.msg', seq), payload_bytes FROM contributions"))
    files = {f.name: f.stat().st_size for f in Path(f"{state_db}.blobs").iterdir() if f.stat().st_size}
    assert files == sizes, "one payload file per row, as long as its row says, and no other (but empty spares)"
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
    assert stats["counts"].tolist() == [sum(results["contributed"].values()), len(DEVICES)]
    A_ref, B_ref = reference_sums(DEVICES)
    np.testing.assert_allclose(stats["A"], A_ref, rtol=1e-12)
    np.testing.assert_allclose(stats["B"], B_ref, rtol=1e-12)


def assert_bit_identical(outputs, reference):
    for got, want in ((outputs[0], reference[0]), (outputs[1], reference[1])):
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name


def test_sigkill_at_every_crash_point_gives_the_uninterrupted_model(tmp_path, reference):
    assert len({c.split(":")[0] for c in CRASHES}) >= 10 and all(c.split(":")[0] in CRASH_POINTS for c in CRASHES)
    prepare(tmp_path, DEVICES)
    state = tmp_path / "state.db"
    logs = []
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES):
        for crash in CRASHES:
            rc, log = run_aggregator(tmp_path, broker.url, state, crash)
            point, _, nth = crash.partition(":")
            assert rc == -9, f"expected a SIGKILL at {crash}, got exit {rc}:\n{log[-3000:]}"
            assert f"crash point {point} reached ({nth or 1})" in log
            logs.append(log)
        rc, log = run_aggregator(tmp_path, broker.url, state)
    assert rc == 0, log[-3000:]
    # killed with a result's payload file written and its row not committed: the next start deleted the file
    assert "removed 1 payload file(s) of no contribution" in logs[CRASHES.index("contribution_file_written") + 1]
    outputs = load_outputs(tmp_path / "out")
    assert_exactly_once(state, outputs)
    assert_bit_identical(outputs, reference)
    # the restarts really resumed: the last run restored the final round's checkpoint, redid nothing
    rounds = assert_rounds_short_only_at_their_deadline(state)
    assert f"restored: {rounds} rounds, checkpoint of round {rounds}, 0 contributions replayed" in log


def assert_rounds_short_only_at_their_deadline(state_db) -> int:
    """Round 1 lives through eight restarts: under load its deadline can pass before its devices'
    results get in; they are dropped and asked again in a later round (3 rounds become 4). That is
    the protocol. What it guarantees: a round ends with fewer contributions than participants only
    because its deadline passed (a restart that gave up a round it should resume would close it
    early). Answers the number of rounds."""
    rows = sqlite3.connect(state_db).execute(
        "SELECT round, participants, deadline, closed_at, outcome FROM rounds ORDER BY round").fetchall()
    for round_, participants, deadline, closed_at, outcome in rows:
        outcome, participants = json.loads(outcome), json.loads(participants)
        missing = sorted(set(participants) - set(outcome["accepted"]))
        if missing:
            # the stored deadline is wall-clock, taken a moment after the tick's monotonic time the
            # round machine counts from: slack for that (a round given up by a restart closes at once)
            assert closed_at >= deadline - 5.0, f"round {round_} closed {deadline - closed_at:.1f}s before its deadline"
            assert sorted(outcome["dropped"]) == missing, (round_, outcome)
    assert [r for r, *_ in rows] == list(range(1, len(rows) + 1))
    return len(rows)


def test_broker_restart_mid_round_gives_the_uninterrupted_model(tmp_path, reference):
    gates = {d: threading.Event() for d in DEVICES}
    broker = MosquittoBroker().start()
    port = broker.port
    store = Store(tmp_path / "state.db")
    cfg = Fed3RConfig(**job_config(DEVICES))
    svc = AggregatorService(Fed3RJob(cfg), BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(tick_s=0.05), enrolled=set(DEVICES), store=store)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=90)), daemon=True)
    thread.start()
    try:
        with Fleet(broker.url, DEVICES, gates=gates):
            deadline = time.time() + 30
            while not store.rounds("ops") and time.time() < deadline:
                time.sleep(0.05)
            first = store.rounds("ops")[0].participants
            gates[first[0]].set()                       # one participant answers, the others are still working
            while not list(store.contributions("ops", with_payload=False)) and time.time() < deadline:
                time.sleep(0.05)
            assert [c.device for c in store.contributions("ops", with_payload=False)] == [first[0]]
            broker.stop()                               # every connection and in-flight message is lost
            time.sleep(0.5)
            broker = MosquittoBroker(port=port).start()
            for g in gates.values():
                g.set()
            thread.join(90)
    finally:
        svc.stop()
        broker.stop()
    assert result["state"] == "done", result
    outputs = load_outputs(tmp_path / "out")
    assert_exactly_once(tmp_path / "state.db", outputs)
    assert_bit_identical(outputs, reference)


# A FedAvgM job (4 rounds of 3 of the 8 devices, server momentum): the crash points it passes.
# (It passes no "evaluation_stored": a round's evaluation is committed with its close.)
FEDAVG_CRASHES = ["presence:2", "restored", "round_opened", "task_sent:2", "result_received", "contribution_stored",
                  "ack_sent", "round_closing", "round_closed", "round_opened:2", "contribution_stored:3",
                  "job_finishing"]


def test_fedavg_job_survives_sigkill_at_every_crash_point(tmp_path):
    """FedAvg: the model after kills and restarts is bit-identical to an uninterrupted run, and no
    update is lost or counted twice (each (round, device) once, rounds of exactly κ updates)."""
    assert len({c.split(":")[0] for c in FEDAVG_CRASHES}) >= 10
    runs = {}
    for name, crashes in (("reference", []), ("crashed", FEDAVG_CRASHES)):
        work = tmp_path / name
        prepare(work, DEVICES, kind="fedavg")
        state = work / "state.db"
        with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, kind="fedavg"):
            for crash in crashes:
                rc, log = run_aggregator(work, broker.url, state, crash)
                assert rc == -9, f"expected a SIGKILL at {crash}, got exit {rc}:\n{log[-3000:]}"
            rc, log = run_aggregator(work, broker.url, state)
        assert rc == 0, log[-3000:]
        rows = sqlite3.connect(state).execute("SELECT round, device, message_id FROM contributions").fetchall()
        assert len({(r, d) for r, d, _ in rows}) == len(rows) == 4 * 3, rows
        assert len({m for _, _, m in rows}) == len(rows)
        runs[name] = (dict(np.load(work / "out" / "model.npz")), sorted((r, d) for r, d, _ in rows),
                      stored_evaluations(state))
    ref, got = runs["reference"], runs["crashed"]
    assert got[1] == ref[1]                       # same seeded participants, round by round
    for k in ref[0]:
        assert np.array_equal(got[0][k], ref[0][k]), k
    # Each round evaluated once, as uninterrupted: an evaluation stored before its round's close and a
    # kill between the two replayed the round and evaluated it again — under DP, a second noise draw
    # of the same devices released (its accuracy) and never counted.
    assert [e["round"] for e in got[2]] == [e["round"] for e in ref[2]] == [1, 2, 3, 4]
    assert got[2] == ref[2]


def stored_evaluations(state_db) -> list[dict]:
    """The job's evaluation history as stored, less what differs between runs (time, bytes)."""
    rows = sqlite3.connect(state_db).execute("SELECT entry FROM evaluations ORDER BY idx").fetchall()
    return [{k: v for k, v in json.loads(e).items() if k not in ("t", "bytes_in", "bytes_out")} for (e,) in rows]


# A Fed3R-Sync job (groups of 4 of the 8 devices under SecAgg): kills in the middle of secure rounds.
# (a secure round stores no per-device contribution: "round_closing" kills it after its sum was applied
# in memory but before the round and its checkpoint were committed)
SECURE_CRASHES = ["round_opened", "task_sent:3", "round_closing", "round_closed", "job_finishing"]


def test_secure_fed3r_sync_job_survives_sigkill(tmp_path):
    """Secure rounds keep no secrets on disk: a round in flight at a crash is closed on restart with
    nothing applied, its devices are asked again, and the final sums are exactly the plain sums
    over all devices (fixed-point resolution): no group sum lost or counted twice."""
    from ops_fleet import SecureKeys

    work = tmp_path / "secure"
    work.mkdir()
    keys = SecureKeys.create(work, DEVICES)
    prepare(work, DEVICES, kind="fed3r-sync", clients_per_round=4, phase_timeout_s=6, max_samples=100,
            **keys.job_fields(work))
    state = work / "state.db"
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, kind="fed3r-sync", secure=keys):
        for crash in SECURE_CRASHES:
            rc, log = run_aggregator(work, broker.url, state, crash)
            assert rc == -9, f"expected a SIGKILL at {crash}, got exit {rc}:\n{log[-3000:]}"
        rc, log = run_aggregator(work, broker.url, state)
    assert rc == 0, log[-3000:]
    model, stats, results = load_outputs(work / "out")
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
    # the devices' extractor hands out float32 features: the plain reference sums those
    A_ref, B_ref = reference_sums(DEVICES, dtype=np.float32)
    np.testing.assert_allclose(stats["A"], A_ref, rtol=1e-10, atol=1e-8)
    np.testing.assert_allclose(stats["B"], B_ref, rtol=1e-10, atol=1e-8)
    assert round(stats["B"][-1].sum()) == 8 * 25         # bias row: every sample summed exactly once


def test_sigkill_at_random_times_gives_the_uninterrupted_model(tmp_path, reference):
    """Not only at named crash points: each aggregator process is SIGKILLed a seeded random delay
    after it first moved the job on (a round opened or a contribution stored — so the kills land
    mid-job however slow the machine is, wherever the process happens to be: receiving, writing,
    evaluating, acking), restarted on the same state, and the final model is the uninterrupted
    run's, bit for bit."""
    rng = np.random.default_rng(14)
    prepare(tmp_path, DEVICES)
    state = tmp_path / "state.db"
    kills = []                              # (rounds, contributions) stored at each kill
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, compute_s=0.3):   # rounds that take a while
        for delay in rng.uniform(0.0, 0.3, size=5):
            before = stored_progress(state)
            proc = start_aggregator_in(tmp_path, broker.url, state)
            deadline = time.monotonic() + 60
            while proc.poll() is None and stored_progress(state) == before and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(delay)
            if proc.poll() is not None:     # the job finished first
                break
            proc.kill()
            proc.wait(10)
            kills.append(stored_progress(state))
        rc, log = run_aggregator(tmp_path, broker.url, state)
    assert rc == 0, log[-3000:]
    assert len(kills) >= 3 and any(0 < n < len(DEVICES) for _, n in kills), kills
    outputs = load_outputs(tmp_path / "out")
    assert_exactly_once(state, outputs)
    assert_bit_identical(outputs, reference)


def stored_progress(state_db) -> tuple[int, int]:
    """(rounds opened, contributions stored) in the state file so far."""
    if not state_db.exists():
        return 0, 0
    with sqlite3.connect(state_db, timeout=10) as db:
        try:
            return tuple(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] for table in ("rounds", "contributions"))
        except sqlite3.OperationalError:      # killed before the schema was written
            return 0, 0
