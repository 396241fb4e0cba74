"""A job whose end raises (``aggregator/service/end_failures.py``, ``JobRunner.finish``), against a
real SQLite store, the failure injected through the job's own end (its release, its finalize):

* which errors may mend, from the real errors a missing, misplaced or looping path and a store
  raise: a path that is gone or of the wrong kind, and an SQL statement the store cannot run, fail
  the same way on every try; a full disk, a failing one and a locked store may mend;
* a stored job whose end fails for good that way ends failed at once, saying why: it used to stay
  running in the store and be tried again, once a minute, for ever;
* one whose end keeps failing for now ends failed after ``end_attempts`` tries in a row, with the
  growing waits between them, saying so with the last error: it used to be tried for ever;
* a job the operator cancelled whose end raises stays cancelled, the error in its record: it used
  to be recorded failed (a deterministic error) or left running for a retry that would resume it
  running (a disk's: the cancel was held by the serving process only; it is stored since,
  tests/test_cancel_durable.py)."""
import errno
import json
import os
import sqlite3
import threading
import time

import pytest
from test_dp_over_mqtt import capping_device
from test_dp_release_at_end import END_JOB, IDS, end_that_raises, serve_with_store
from test_job_end_without_store import one_result_runner

from aggregator.service.end_failures import is_transient
from aggregator.service.job_lifecycle import control_job, create_job
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.schema import JobState
from aggregator.storage.store import Store
from edge_client.agent import DeviceAgent
from protocols.mqtt_link import BrokerConfig


def raised(action) -> BaseException:
    try:
        action()
    except BaseException as exc:
        return exc
    raise AssertionError(f"{action} did not raise")


def missing_blob(tmp_path) -> BaseException:
    return raised(lambda: open(tmp_path / "held-sums.npy", "rb"))


def sql_the_store_cannot_run(tmp_path) -> BaseException:
    return raised(lambda: sqlite3.connect(tmp_path / "old.db").execute("SELECT sums FROM held_rounds"))


def locked_store(tmp_path) -> BaseException:
    holder = sqlite3.connect(tmp_path / "locked.db", isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        return raised(lambda: sqlite3.connect(tmp_path / "locked.db", timeout=0).execute("SELECT * FROM t"))
    finally:
        holder.rollback()


def folder_as_file(tmp_path) -> BaseException:
    return raised(lambda: open(tmp_path, "rb"))


def below_a_file(tmp_path) -> BaseException:
    (tmp_path / "blob").write_bytes(b"")
    return raised(lambda: open(tmp_path / "blob" / "part", "rb"))


def link_loop(tmp_path) -> BaseException:
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    return raised(lambda: open(tmp_path / "loop", "rb"))


def name_too_long(tmp_path) -> BaseException:
    return raised(lambda: open(tmp_path / ("n" * 300), "rb"))


def os_error(code: int):
    return lambda tmp_path: OSError(code, os.strerror(code))


@pytest.mark.parametrize("make_error, may_mend", [
    (missing_blob, False), (folder_as_file, False), (below_a_file, False), (link_loop, False),
    (name_too_long, False), (sql_the_store_cannot_run, False),
    (lambda tmp_path: PermissionError(errno.EACCES, os.strerror(errno.EACCES), "held-sums.npy"), False),
    (lambda tmp_path: ValueError("the held sums are not finite"), False),
    (os_error(errno.ENOSPC), True), (os_error(errno.EDQUOT), True), (os_error(errno.EIO), True),
    (os_error(errno.EROFS), True), (lambda tmp_path: OSError("disk I/O error"), True),
    (lambda tmp_path: MemoryError("no room for the noise"), True), (locked_store, True),
])
def test_what_may_mend_is_tried_again_and_what_cannot_is_not(tmp_path, make_error, may_mend):
    error = make_error(tmp_path)
    assert is_transient(error) is may_mend, repr(error)


@pytest.mark.parametrize("make_error", [missing_blob, sql_the_store_cannot_run])
def test_a_stored_job_whose_end_fails_for_good_fails_at_once(broker, tmp_path, monkeypatch, make_error):
    error = make_error(tmp_path)
    store = Store(tmp_path / "state.db")
    tries = end_that_raises(monkeypatch, error)
    result, _ = serve_with_store(broker, tmp_path / "out", store, timeout=60)
    reason = f"the job cannot end: {type(error).__name__}: {error}"
    assert "raised" not in result and len(tries) == 1
    row = store.job("dp-end")
    assert row["state"] == "failed" and row["summary"]["error"] == reason and store.models("dp-end") == []
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["state"] == "failed" and saved["error"] == reason
    assert not (tmp_path / "out" / "model.npz").exists()


def test_an_end_that_keeps_failing_for_now_fails_its_job_after_its_attempts(broker, tmp_path, monkeypatch):
    """Served as the admin API serves (``keep_serving``): three tries, 1 s and 2 s apart, then failed."""
    store = Store(tmp_path / "state.db")
    tries = end_that_raises(monkeypatch, OSError("disk I/O error"))
    create_job(store, "fed3r", END_JOB)
    control_job(store, None, "dp-end", "start")
    out = tmp_path / "out"
    svc = AggregatorService(None, BrokerConfig.from_url(broker.url), out,
                            ServiceSettings(evaluate_every_contribution=False, keep_serving=True, tick_s=0.05,
                                            end_attempts=3),
                            enrolled=set(IDS), store=store)
    thread = threading.Thread(target=svc.run, kwargs={"timeout_s": 90}, daemon=True)
    thread.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url),
                          {"fed3r.stats": capping_device(i, out / "devices")}).start() for i, d in enumerate(IDS)]
    deadline = time.monotonic() + 60
    # the old code tried on: a fourth try (at ~7 s) ends the wait
    while store.job("dp-end")["state"] != "failed" and len(tries) <= 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    svc.stop()
    thread.join(30)
    for agent in agents:
        agent.stop()
    assert len(tries) == 3, [round(t - tries[0], 2) for t in tries]
    assert all(b - a >= 0.9 * 2 ** i for i, (a, b) in enumerate(zip(tries, tries[1:])))     # the growing waits
    reason = "the job could not end after 3 attempts: OSError: disk I/O error"
    row = store.job("dp-end")
    assert row["state"] == "failed" and row["summary"]["error"] == reason and store.models("dp-end") == []
    saved = json.loads((out / "dp-end" / "results.json").read_text())
    assert saved["state"] == "failed" and saved["error"] == reason
    assert not (out / "dp-end" / "model.npz").exists()


@pytest.mark.parametrize("error", [ValueError("the held sums are not finite"), OSError("disk I/O error")])
def test_a_cancelled_job_whose_end_raises_stays_cancelled_with_the_error_in_its_record(tmp_path, monkeypatch, error):
    store = Store(tmp_path / "state.db")
    runner = one_result_runner(tmp_path, store)
    a = runner.a
    control_job(store, a, a.job_id, "cancel")        # the operator's cancel of the served job
    runner.tick(time.monotonic())                   # its open round closes,
    runner.tick(time.monotonic())                   # then the job is over
    assert a.final_state == JobState.CANCELLED and store.job(a.job_id)["state"] == JobState.CANCELLING

    def finalize(self):
        raise error

    monkeypatch.setattr(type(a.job), "finalize", finalize)
    round_models = store.models(a.job_id)          # its closed round's
    summary = runner.finish()
    reason = f"the job cannot end: {type(error).__name__}: {error}"
    assert a.uncommitted is None            # not left for a retry: the operator asked for its end
    assert summary["state"] == JobState.CANCELLED and summary["error"] == reason
    row = store.job(a.job_id)
    assert row["state"] == JobState.CANCELLED and row["summary"]["error"] == reason
    assert store.models(a.job_id) == round_models and not any(m["final"] for m in round_models)   # no final model
    saved = json.loads((a.out_dir / "results.json").read_text())
    assert saved["state"] == JobState.CANCELLED and saved["error"] == reason
    assert not (a.out_dir / "model.npz").exists()


def test_a_service_restarted_within_every_wait_counts_its_jobs_end_failures_on(broker, tmp_path, monkeypatch):
    """Each service here is a process started again (its own waits and counts, the store shared),
    as a service that crashes or is restarted within every retry's wait: the third try in a row,
    whichever process makes it, ends the job failed. The count was the process's: every restart
    tried from 0, so the job stayed running in the store, tried for ever."""
    store = Store(tmp_path / "state.db")
    tries = end_that_raises(monkeypatch, OSError("disk I/O error"))
    settings = ServiceSettings(evaluate_every_contribution=False, end_attempts=3)
    for started in (1, 2, 3):
        result, _ = serve_with_store(broker, tmp_path / "out", store, timeout=60, settings=settings)
        assert "raised" not in result and len(tries) == started
        if started < 3:                                 # tried again: nothing of it published
            assert result == {} and store.job("dp-end")["state"] == "running"
            assert store.job("dp-end")["end_failures"] == started
    reason = "the job could not end after 3 attempts: OSError: disk I/O error"
    row = store.job("dp-end")
    assert row["state"] == "failed" and row["summary"]["error"] == reason and store.models("dp-end") == []
    assert result["state"] == "failed" and result["error"] == reason
    assert json.loads((tmp_path / "out" / "results.json").read_text())["error"] == reason


def test_a_store_that_cannot_take_the_final_model_fails_the_job_with_its_record(broker, tmp_path):
    """The commit of the job's final state is part of its end: a store that cannot run its statement
    (here its models table is gone: SQLITE_ERROR, which never mends) fails the job at once, its
    record committed without the model. It used to raise out of the service's run (and out of its
    ``finally``, which finished the job again), leaving the job running in the store for every
    restart to end again the same way."""
    store = Store(tmp_path / "state.db")
    store.db.execute("DROP TABLE models")       # a damaged store; no round of this job stores a model version
    result, _ = serve_with_store(broker, tmp_path / "out", store, timeout=60)
    reason = "the job cannot end: OperationalError: no such table: models"
    assert "raised" not in result and result["state"] == "failed" and result["error"] == reason
    row = store.job("dp-end")
    assert row["state"] == "failed" and row["summary"]["error"] == reason and row["end_failures"] == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["state"] == "failed" and saved["error"] == reason
    assert not (tmp_path / "out" / "model.npz").exists() and not (tmp_path / "out" / "statistics.npz").exists()


def test_a_job_whose_record_cannot_be_committed_either_is_tried_again(tmp_path, monkeypatch):
    """A cancelled job is not tried again for its end: its record is committed at once, without
    the model. Where the store cannot commit even that (its disk fails), nothing of the job is
    published and it stays as stored (cancelling: taken up again after a wait or a restart, its
    failure counted); the error used to raise out of ``finish``, and out of the service's loop."""
    store = Store(tmp_path / "state.db")
    runner = one_result_runner(tmp_path, store)
    a = runner.a
    control_job(store, a, a.job_id, "cancel")
    runner.tick(time.monotonic())                   # its open round closes,
    runner.tick(time.monotonic())                   # then the job is over
    assert a.final_state == JobState.CANCELLED
    commits = []

    def finish_job(self, job_id, state, summary, counters, final_model, metrics, round_):
        commits.append(final_model is not None)
        raise OSError("disk I/O error")

    monkeypatch.setattr(Store, "finish_job", finish_job)
    assert runner.finish() == {}
    assert commits == [True, False]                 # with its model, then its record only
    assert a.uncommitted == "the job's end"         # the service takes it up again (after a wait)
    row = store.job(a.job_id)
    assert row["state"] == JobState.CANCELLING and row["end_failures"] == 1
    assert not (a.out_dir / "results.json").exists()
