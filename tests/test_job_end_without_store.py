"""A job served without a store (``aggregator serve`` with no ``--state``) whose end raises one of
the errors a later try gets past (``end_failures.TRANSIENT_END_ERRORS``: a disk's, the memory's) has no later
try: nothing resumes a job that is not stored. It ends failed, saying why, its record written, as
an end that fails for good does; it used to vanish (an empty summary, no results.json, the service
logging that it would be resumed) (a review's finding)."""
import json
import time

import pytest

from aggregator.jobs.registry import build_job
from aggregator.security.fleet import Fleet
from aggregator.service.active_job import ActiveJob, ValidatedResult
from aggregator.service.crash_points import CrashPoints
from aggregator.service.job_runner import JobRunner, RunnerServices
from aggregator.service.recovery import open_stored
from aggregator.storage.schema import JobState
from aggregator.storage.store import Store
from protocols.envelope import decode
from protocols.rounds import ResultArrived

from test_shard_ingest import CONFIG, DEVICES, result


def storeless_runner(tmp_path) -> JobRunner:
    """A Fed3R job of one device, its one round's result applied, run without a store."""
    return one_result_runner(tmp_path, None)


def one_result_runner(tmp_path, store: Store | None) -> JobRunner:
    """A Fed3R job of one device, its one round's result applied, run with ``store`` (its row made there)."""
    a = ActiveJob(build_job("fed3r", {**CONFIG, "clients_per_round": 1}), "fed3r", tmp_path / "out")
    a.out_dir.mkdir()
    if store is not None:
        open_stored(a, store, True, CrashPoints())
    runner = JobRunner(a, RunnerServices(
        fleet=Fleet(store, None, set(DEVICES), False), store=store, crash=CrashPoints(),
        send=lambda device, env: None, publish_status=lambda body: None, bytes_sent=lambda: 0,
        on_fatal=lambda reason, stop=False: None))
    device = DEVICES[0]
    assert a.job.next_participants({device}) == [device]
    runner._open_round([device], time.monotonic())
    raw = result(0, round_=1)
    env = decode(raw)
    runner.handle(a.rounds[1], ResultArrived(device, env.id, ValidatedResult(a.job.parse_result(env), raw)))
    assert a.job.contributed == {device: 4}
    return runner


@pytest.mark.parametrize("error", [MemoryError("no room for the end's draw"), OSError("disk I/O error")])
def test_a_transient_end_failure_without_a_store_fails_the_job_with_its_record(tmp_path, monkeypatch, error):
    runner = storeless_runner(tmp_path)
    a = runner.a
    a.final_state = JobState.DONE           # ran out of work

    def finalize(self):
        raise error

    monkeypatch.setattr(type(a.job), "finalize", finalize)
    summary = runner.finish()
    reason = f"the job cannot end: {type(error).__name__}: {error}"
    assert a.uncommitted is None            # nothing is waiting for a resume that never comes
    assert summary["state"] == JobState.FAILED and summary["error"] == reason
    saved = json.loads((a.out_dir / "results.json").read_text())
    assert saved["state"] == JobState.FAILED and saved["error"] == reason
    assert not (a.out_dir / "model.npz").exists()       # nothing made from the state its end left
