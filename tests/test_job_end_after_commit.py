"""What follows the commit of a job's final state (``JobRunner.finish``: ``end_failures.after_commit``):
its files, its round log's line, its devices' job-end notice, its status. The end is durable by
then, so each fails on its own, logged, the others still done, and the service goes on:

* over mosquitto, a real SQLite store: a Scaffold job of one round on two Python devices whose end
  meets a full disk (results.json) and a store that cannot keep the job-end notices. The service
  returns the job done, the devices drop its state (the notice went out from memory), its status
  and round-log line are out; the next start lists the notice again from the store's finished job,
  and stores it. The full disk used to raise out of ``finish`` and out of the service's run, the
  devices never told; a store failing in ``set_setting`` did the same;
* the notices a start lists again (``job_end.restored_notices``): every stateful job among the
  lately finished that the stored list lacks, in the order the jobs finished, after the older
  entries; nothing for a job whose devices keep nothing, nor for one stopped (not an end);
* a status that cannot be published and files that cannot be written leave the round log's line
  and the committed end (a runner, a real store)."""
from __future__ import annotations

import errno
import json
import os
import sqlite3
import threading
import time

import pytest
from test_job_end import DEVICES, RUN_A, RUN_B, RUN_C, wait_for
from test_job_end_without_store import one_result_runner

from aggregator.jobs.device_state_fields import RUN_KEY
from aggregator.service import reporting
from aggregator.service.job_end import SETTING, JobEndNotices
from aggregator.service.loop import AggregatorService
from aggregator.storage.round_log import FILE_NAME as ROUND_LOG
from aggregator.storage.schema import JobState
from aggregator.storage.store import Store
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.job_end import JobEnded
from protocols.topics import AGGREGATOR_ID, Topics


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def store_failing_on(monkeypatch, key: str) -> None:
    """``Store.set_setting`` fails (its disk) for ``key`` only: the job's own writes go through."""
    real = Store.set_setting

    def set_setting(self, name, value):
        if name == key:
            raise sqlite3.OperationalError("disk I/O error")
        return real(self, name, value)

    monkeypatch.setattr(Store, "set_setting", set_setting)


def scaffold_agents(broker, topics: Topics, key: bytes, folder):
    """The two devices of a Scaffold job, each keeping its state in a store of its own."""
    from ops_fleet import Features
    from java_tasks import D, device_data

    from edge_client.agent import DeviceAgent
    from edge_client.state import DeviceStateStore
    from edge_client.tasks.scaffold_training import ScaffoldTrainingTask

    stores = {d: DeviceStateStore(folder / d) for d in DEVICES}
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url),
                          {"scaffold.head": ScaffoldTrainingTask(*device_data(i), lambda b, s, w: Features(D), stores[d])},
                          topics=topics, retry_after_s=2, aggregator_key=key, state=stores[d]).start()
              for i, d in enumerate(DEVICES)]
    return agents, stores


@pytest.mark.parametrize("disk_full", [True, False])
def test_a_full_disk_and_a_failing_notice_store_after_the_commit_leave_the_end_told(broker, tmp_path, monkeypatch,
                                                                                     disk_full):
    """``disk_full``: results.json cannot be written either (else only the notices' store fails)."""
    from java_tasks import C, D

    from aggregator.jobs.scaffold import ScaffoldConfig, ScaffoldJob
    from aggregator.service.settings import ServiceSettings

    topics = Topics("jobendfail")       # a root of this test's own: nothing retained from another
    aggregator = DeviceIdentity.generate(AGGREGATOR_ID)
    job = ScaffoldJob(ScaffoldConfig(job_id="scaffold-end", num_classes=C, feature_dim=D, rounds=1,
                                     clients_per_round=2, round_timeout_s=30, local_epochs=1, batch_size=8,
                                     client_lr=0.05, expected_devices=2, start_timeout_s=20, seed=5))
    store = Store(tmp_path / "agg.db")
    statuses = []
    real_status = AggregatorService._publish_status
    monkeypatch.setattr(AggregatorService, "_publish_status",
                        lambda self, body: (statuses.append(body), real_status(self, body)))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(topic_root=topics.root, tick_s=0.05, evaluate_every_contribution=False),
                            store=store, identity=aggregator)
    key = bytes.fromhex(svc.enroll(DEVICES[0]).aggregator_public_key)
    svc.enroll(DEVICES[1])
    if disk_full:
        monkeypatch.setattr(reporting, "write_job_files", full_disk)
    working_set_setting = Store.set_setting
    store_failing_on(monkeypatch, SETTING)
    agents, stores = scaffold_agents(broker, topics, key, tmp_path / "state")
    outcome: dict = {}

    def serve():
        try:
            outcome["summary"] = svc.run(timeout_s=30)
        except BaseException as exc:        # the old code: the full disk ended the service's run
            outcome["raised"] = exc

    try:
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        thread.join(35)
        assert "raised" not in outcome, outcome
        summary = outcome["summary"]
        assert summary["state"] == "done" and sorted(summary["contributed"]) == DEVICES, summary
        assert store.job("scaffold-end")["state"] == JobState.DONE          # committed before all of it
        assert (tmp_path / "out" / "results.json").exists() is not disk_full
        assert store.setting(SETTING) is None                               # the store could not keep the notice
        # published all the same: each device dropped the job's state
        assert wait_for(lambda: all(stores[d].jobs() == [] for d in DEVICES)), {d: stores[d].jobs() for d in DEVICES}
        lines = [json.loads(line) for line in (tmp_path / "out" / ROUND_LOG).read_text().splitlines()]
        assert [line["state"] for line in lines if line["event"] == "job_end"] == ["done"]
        assert statuses[-1]["state"] == "done"
    finally:
        for agent in agents:
            agent.stop()
    monkeypatch.setattr(Store, "set_setting", working_set_setting)     # the store mended; the service starts again
    want = [JobEnded("scaffold-end", job.device_state.run, "done")]
    restarted = AggregatorService(None, BrokerConfig.from_url(broker.url), tmp_path / "out", store=store)
    assert restarted.job_ends.notices == want                 # listed again from the store's finished job
    assert [JobEnded.from_wire(e) for e in json.loads(store.setting(SETTING))] == want      # and stored now


def test_a_start_lists_again_the_notices_of_lately_finished_stateful_jobs_its_list_lacks(tmp_path):
    store = Store(tmp_path / "agg.db")
    for job_id, kind, run in (("old", "scaffold", RUN_A), ("stateful", "scaffold", RUN_B), ("plain", "fed3r", None),
                              ("stopped", "pp", RUN_C), ("cancelled", "pp", RUN_C)):
        store.create_job(job_id, kind, {"job_id": job_id})
        store.open_round(job_id, 1, ["d0"], {"d0": "t" * 32}, {RUN_KEY: run} if run else {}, time.time() + 60)
    store.create_job("never-ran", "ditto", {"job_id": "never-ran"})
    for job_id, state in (("old", "done"), ("stateful", "failed"), ("plain", "done"), ("stopped", "stopped"),
                          ("never-ran", "cancelled"), ("cancelled", "cancelled")):
        store.set_job_state(job_id, state)
        time.sleep(0.01)                    # each finishes after the one before
    store.set_setting(SETTING, json.dumps([JobEnded("old", RUN_A, "done").to_wire()]))     # the only end it kept
    sent = []
    notices = JobEndNotices(store, sent.append)
    want = [JobEnded("old", RUN_A, "done"), JobEnded("stateful", RUN_B, "failed"),
            JobEnded("cancelled", RUN_C, "cancelled")]
    assert notices.notices == want
    assert [JobEnded.from_wire(e) for e in json.loads(store.setting(SETTING))] == want
    notices.publish()
    assert [JobEnded.from_wire(e) for e in sent[0].body["ended"]] == want
    # a job that ended before every lately finished one keeps its place ahead of them
    store.set_setting(SETTING, json.dumps([JobEnded("gone", RUN_B, "done").to_wire(), want[0].to_wire()]))
    assert JobEndNotices(store, sent.append).notices == [JobEnded("gone", RUN_B, "done"), *want]


def test_a_status_and_files_that_cannot_go_out_leave_the_committed_end_and_its_round_log_line(tmp_path, monkeypatch):
    store = Store(tmp_path / "agg.db")
    runner = one_result_runner(tmp_path, store)
    a = runner.a
    a.final_state = JobState.DONE           # ran out of work

    def no_broker(body):
        raise ConnectionError("the broker is gone")

    runner.publish_status_body = no_broker
    monkeypatch.setattr(reporting, "write_job_files", full_disk)
    summary = runner.finish()
    assert summary["state"] == JobState.DONE and a.uncommitted is None
    assert store.job(a.job_id)["state"] == JobState.DONE
    assert [m["final"] for m in store.models(a.job_id)] == [False, True]    # its round's, then the final model
    assert summary["contributed"] == a.job.contributed
    lines = [json.loads(line) for line in (a.out_dir / ROUND_LOG).read_text().splitlines()]
    assert [line["state"] for line in lines if line["event"] == "job_end"] == ["done"]
    assert not (a.out_dir / "results.json").exists()
