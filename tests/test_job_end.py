"""``job.ended`` (protocols/payloads/job_end.py, aggregator/service/job_end.py): when a stateful job
ends, its devices drop the state they kept for it, and nothing else.

* the payload refuses every malformed part as a whole; the list stays bounded;
* the aggregator's list of ended jobs is stored, survives a restart, and names the run a job
  cancelled while not served left in its last round's bookkeeping;
* over mosquitto: a Scaffold job of one round on two Python devices; after it completes, each
  device's state for it is gone (it was there after the task), another job's state stays; a
  notice signed by another key, an unsigned one and a genuine one of an older run (a replay)
  change nothing, while the genuine notice of the run held drops it.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from protocols.envelope import EnvelopeError, decode, encode
from protocols.identity import DeviceIdentity
from protocols.payloads.job_end import (MAX_NOTICES, JobEnded, job_ended_message, parse_job_ended,
                                        with_ended)
from protocols.topics import AGGREGATOR_ID, Topics

RUN_A, RUN_B, RUN_C = "a" * 16, "b" * 16, "c" * 16


def notice_envelope(entries):
    env = job_ended_message(AGGREGATOR_ID, [])
    env.body["ended"] = entries
    return decode(encode(env))


def test_a_notice_survives_the_wire_and_every_malformed_part_refuses_the_whole_message():
    notices = [JobEnded("j1", RUN_A, "done"), JobEnded("j2", RUN_B, "cancelled"), JobEnded("j3", RUN_C, "failed")]
    assert parse_job_ended(decode(encode(job_ended_message(AGGREGATOR_ID, notices)))) == notices
    good = notices[0].to_wire()
    for bad in ([{**good, "run": "XYZ"}], [{**good, "reason": "stopped"}], [{**good, "job": ""}],
                [{**good, "job": "j" * 129}], [{**good, "extra": 1}], [{"job": "j1", "run": RUN_A}], ["j1"],
                [good] * (MAX_NOTICES + 1), [{**good, "run": 12345678}]):
        with pytest.raises(EnvelopeError):
            parse_job_ended(notice_envelope(bad))
    with pytest.raises(EnvelopeError):
        parse_job_ended(decode(encode(job_ended_message(AGGREGATOR_ID, []).__class__(
            type="job.ended", sender=AGGREGATOR_ID, body={"ended": "j1"}))))


def test_the_list_keeps_the_newest_notice_per_job_and_at_most_max_notices():
    notices: list[JobEnded] = []
    for i in range(MAX_NOTICES + 5):
        notices = with_ended(notices, JobEnded(f"j{i}", RUN_A, "done"))
    assert [n.job for n in notices] == [f"j{i}" for i in range(5, MAX_NOTICES + 5)]
    again = with_ended(notices, JobEnded("j7", RUN_B, "cancelled"))
    assert len(again) == MAX_NOTICES and again[-1] == JobEnded("j7", RUN_B, "cancelled")
    assert [n.job for n in again].count("j7") == 1


def test_drop_run_drops_only_the_run_that_ended(tmp_path):
    from edge_client.state import DeviceStateStore

    store = DeviceStateStore(tmp_path)
    store.save("j", RUN_A, 1, {"c": np.ones(3, np.float32)})
    assert not store.drop_run("j", RUN_B) and store.jobs() == ["j"]       # an older run's notice
    assert not store.drop_run("other", RUN_A) and store.jobs() == ["j"]   # a job this device holds nothing of
    assert store.drop_run("j", RUN_A) and store.jobs() == []
    assert not store.drop_run("j", RUN_A)                                 # twice: harmless


def test_the_aggregator_stores_its_list_and_finds_the_run_of_a_job_cancelled_while_not_served(tmp_path):
    from aggregator.jobs.device_state_fields import RUN_KEY
    from aggregator.service.job_end import JobEndNotices
    from aggregator.storage.store import Store

    store = Store(tmp_path / "agg.db")
    sent = []
    notices = JobEndNotices(store, sent.append)
    notices.publish()
    assert sent == []                                         # nothing ended yet: nothing retained
    for job_id, bookkeeping in (("stateful", {RUN_KEY: RUN_B}), ("plain", {})):
        store.create_job(job_id, "scaffold", {"job_id": job_id})
        store.open_round(job_id, 1, ["d0"], {"d0": "t" * 32}, bookkeeping, time.time() + 60)
    assert notices.ended("stateful", "cancelled") == JobEnded("stateful", RUN_B, "cancelled")
    assert notices.ended("plain", "done") is None             # its devices keep nothing
    assert notices.ended("stateful", "stopped") is None       # not an end: it may be started again
    assert parse_job_ended(decode(encode(sent[-1]))) == [JobEnded("stateful", RUN_B, "cancelled")]
    restarted = []
    JobEndNotices(store, restarted.append).publish()          # a restarted service publishes the same list
    assert parse_job_ended(decode(encode(restarted[0]))) == [JobEnded("stateful", RUN_B, "cancelled")]


def test_an_operator_cancelling_a_job_not_served_announces_its_end_even_with_no_broker_now(tmp_path):
    """The cancel is stored and the notice listed (stored) at once; publishing it fails (no broker
    here) without failing the cancel: it goes out on the service's next connect."""
    from aggregator.jobs.device_state_fields import RUN_KEY
    from aggregator.service.job_end import SETTING
    from aggregator.service.loop import AggregatorService
    from aggregator.storage.store import Store
    from protocols.mqtt_link import BrokerConfig

    store = Store(tmp_path / "agg.db")
    svc = AggregatorService(None, BrokerConfig.from_url("mqtt://127.0.0.1:1"), tmp_path / "out", store=store)
    svc.create_job("scaffold", {"job_id": "s1", "num_classes": 3, "feature_dim": 4})
    store.open_round("s1", 1, ["d0"], {"d0": "t" * 32}, {RUN_KEY: RUN_A}, time.time() + 60)
    assert svc.control_job("s1", "cancel")["state"] == "cancelled"
    assert [JobEnded.from_wire(e) for e in json.loads(store.setting(SETTING))] == [JobEnded("s1", RUN_A, "cancelled")]


# ---------------------------------------------------------------------------------------------- over mosquitto
DEVICES = ["end0", "end1"]


def wait_for(check, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_devices_drop_a_completed_jobs_state_and_refuse_forged_and_replayed_notices(broker, tmp_path):
    from ops_fleet import Features
    from test_aggregator_over_mqtt import raw_client
    from java_tasks import C, D, device_data

    from aggregator.jobs.scaffold import ScaffoldConfig, ScaffoldJob
    from aggregator.service.loop import AggregatorService
    from aggregator.service.settings import ServiceSettings
    from aggregator.storage.store import Store
    from edge_client.agent import DeviceAgent
    from edge_client.state import DeviceStateStore
    from edge_client.tasks.scaffold_training import ScaffoldTrainingTask
    from protocols.mqtt_link import BrokerConfig

    topics = Topics("jobend")           # the session's broker keeps retained messages: a root of this test's own
    aggregator = DeviceIdentity.generate(AGGREGATOR_ID)
    job = ScaffoldJob(ScaffoldConfig(job_id="scaffold-end", num_classes=C, feature_dim=D, rounds=1,
                                     clients_per_round=2, round_timeout_s=30, local_epochs=1, batch_size=8,
                                     client_lr=0.05, expected_devices=2, start_timeout_s=20, seed=5))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(topic_root=topics.root, tick_s=0.05, evaluate_every_contribution=False),
                            store=Store(tmp_path / "agg.db"), identity=aggregator)
    key = bytes.fromhex(svc.enroll(DEVICES[0]).aggregator_public_key)
    svc.enroll(DEVICES[1])
    stores = {d: DeviceStateStore(tmp_path / "state" / d) for d in DEVICES}
    held_after_task: dict[str, list[str]] = {}

    def handler(i: int, d: str):
        task = ScaffoldTrainingTask(*device_data(i), lambda b, s, w: Features(D), stores[d])

        def run(params, tensors):
            out = task(params, tensors)
            held_after_task[d] = stores[d].jobs()
            return out
        return run

    for d in DEVICES:                   # another job's state, which this job's end must leave alone
        stores[d].save("other", RUN_B, 3, {"c": np.ones(3, np.float32)})
        stores[d].save("marker", RUN_C, 3, {"c": np.ones(3, np.float32)})
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"scaffold.head": handler(i, d)}, topics=topics,
                          retry_after_s=2, aggregator_key=key, state=stores[d]).start()
              for i, d in enumerate(DEVICES)]
    publisher = raw_client(broker)
    try:
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=30)), daemon=True)
        thread.start()
        thread.join(35)
        assert result.get("state") == "done" and sorted(result["contributed"]) == DEVICES, result
        assert all(sorted(held_after_task[d]) == ["marker", "other", "scaffold-end"] for d in DEVICES), held_after_task
        assert wait_for(lambda: all(sorted(stores[d].jobs()) == ["marker", "other"] for d in DEVICES)), \
            {d: stores[d].jobs() for d in DEVICES}

        forger = DeviceIdentity.generate(AGGREGATOR_ID)           # the aggregator's name, another key
        drop_other = job_ended_message(AGGREGATOR_ID, [JobEnded("other", RUN_B, "done")])
        replay = job_ended_message(AGGREGATOR_ID, [JobEnded("other", RUN_A, "done")])   # an older run of "other"
        for raw in (encode(drop_other, signer=forger.sign), encode(drop_other), encode(replay, signer=aggregator.sign),
                    encode(job_ended_message(AGGREGATOR_ID, [JobEnded("marker", RUN_C, "done")]),
                           signer=aggregator.sign)):
            publisher.publish(topics.job_ends, raw, qos=1).wait_for_publish(5)
        # one topic, QoS 1: the marker's notice arrives after the others, so once it is handled they are
        assert wait_for(lambda: all(stores[d].jobs() == ["other"] for d in DEVICES)), \
            {d: stores[d].jobs() for d in DEVICES}
        publisher.publish(topics.job_ends, encode(drop_other, signer=aggregator.sign), qos=1).wait_for_publish(5)
        assert wait_for(lambda: all(stores[d].jobs() == [] for d in DEVICES))    # the genuine notice does drop it
    finally:
        for a in agents:
            a.stop()
        publisher.publish(topics.job_ends, b"", qos=1, retain=True).wait_for_publish(5)    # the broker keeps nothing
        publisher.loop_stop()


def python_device_answers(folder, notices: list[bytes], key: bytes) -> list[str]:
    """What the Python device's store answers to each message (the reference for the Java device)."""
    from edge_client.state import DeviceStateStore
    from protocols.identity import sender_verifier

    store, answers = DeviceStateStore(folder), []
    for raw in notices:
        try:
            ended = parse_job_ended(decode(raw, sender_verifier(AGGREGATOR_ID, key)))
        except EnvelopeError:
            answers.append("REFUSED")
            continue
        answers.append("ENDED " + ",".join(n.job for n in ended if store.drop_run(n.job, n.run)))
    return answers + ["JOBS " + ",".join(sorted(store.jobs()))]


@pytest.fixture(scope="module")
def java_cp() -> str:
    """The Java library and its test drivers, built once per run (shared with the other Java tests)."""
    import java_build

    if java_build.missing() is not None:
        pytest.skip(java_build.missing())
    return java_build.built()


def test_the_java_device_applies_job_ended_as_the_python_device_does(java_cp, tmp_path):
    """Both libraries' stores hold the same jobs (written by the Python store; the Java store opens
    the same files); the same signed messages — a forged one, an unsigned one, a replay of an older
    run, a malformed one, then the genuine one — leave the same jobs in each."""
    import subprocess

    import java_build
    from edge_client.state import DeviceStateStore

    aggregator, forger = DeviceIdentity.generate(AGGREGATOR_ID), DeviceIdentity.generate(AGGREGATOR_ID)
    genuine = job_ended_message(AGGREGATOR_ID, [JobEnded("j1", RUN_A, "done"), JobEnded("j3", RUN_C, "failed"),
                                                JobEnded("absent", RUN_A, "cancelled")])
    malformed = job_ended_message(AGGREGATOR_ID, [JobEnded("j2", RUN_B, "done")])
    malformed.body["ended"].append({"job": "j1", "run": RUN_A, "reason": "stopped"})
    notices = [encode(genuine, signer=forger.sign), encode(genuine),
               encode(job_ended_message(AGGREGATOR_ID, [JobEnded("j2", RUN_A, "done")]), signer=aggregator.sign),
               encode(malformed, signer=aggregator.sign), encode(genuine, signer=aggregator.sign)]
    for side in ("py", "java"):
        store = DeviceStateStore(tmp_path / side)
        for job, run in (("j1", RUN_A), ("j2", RUN_B), ("j3", RUN_C)):
            store.save(job, run, 1, {"x": np.arange(3, dtype=np.float32)})
    want = python_device_answers(tmp_path / "py", notices, aggregator.public_key_bytes)
    assert want == ["REFUSED", "REFUSED", "ENDED ", "REFUSED", "ENDED j1,j3", "JOBS j2"]     # the reference itself
    script = ["open 1000000"]
    for i, raw in enumerate(notices):
        (tmp_path / f"notice{i}.bin").write_bytes(raw)
        script.append(f"ended {tmp_path / f'notice{i}.bin'} {aggregator.public_key_bytes.hex()}")
    (tmp_path / "script").write_text("\n".join(script + ["open 1000000"]) + "\n")
    out = subprocess.run(java_build.java_command("-cp", java_cp, "StateRunner", str(tmp_path / "java"),
                                                 str(tmp_path / "script")),
                         capture_output=True, text=True, timeout=60)
    answers = out.stdout.splitlines()
    assert answers[0] == "JOBS j1,j2,j3", out.stderr
    assert [a.split(" ")[0] if a.startswith("REFUSED") else a for a in answers[1:]] == want, out.stdout + out.stderr
    assert sorted(DeviceStateStore(tmp_path / "java").jobs()) == ["j2"]      # the Python store reads what Java left


def scaffold_task(aggregator: DeviceIdentity, job: str, run: str, round_: int) -> bytes:
    """A signed ``scaffold.head`` task of ``job``'s ``run`` on the golden vectors' recipe and head."""
    from edge_client import golden_training as g
    from protocols import messages as M

    params = {**g.STATEFUL_RECIPE, "job_id": job,
              "state": {"run": run, "round": round_, "max_staleness": 5, "ttl_s": 3600.0}}
    env = M.task_message(AGGREGATOR_ID, job, round_, "scaffold.head", params, time.time() + 60)
    env.tensors.update(g.round_tensors("scaffold.head", round_))
    return encode(env, signer=aggregator.sign)


def test_a_stateful_task_queued_behind_its_jobs_end_is_skipped_and_writes_nothing(broker, tmp_path):
    """The device is busy while the aggregator's ``job.ended`` and then a late task of that run
    (sent before the job ended) queue up: once the notice is handled the task is skipped with one
    reason and the job's state is not written again (it was, and stayed until the job's horizon);
    a task of another run of the same job id still runs."""
    from test_aggregator_over_mqtt import raw_client

    from edge_client import golden_training as g
    from edge_client.agent import DeviceAgent
    from edge_client.state import DeviceStateStore
    from edge_client.tasks.scaffold_training import ScaffoldTrainingTask
    from protocols.mqtt_link import BrokerConfig

    topics, job = Topics("lateend"), "scaffold-late"
    aggregator = DeviceIdentity.generate(AGGREGATOR_ID)
    store = DeviceStateStore(tmp_path / "state")
    store.save(job, RUN_A, 1, {"c": np.ones(3, np.float32)})        # what its round 1 left
    handler = ScaffoldTrainingTask(*g.features(), lambda b, s, w: g._GivenFeatures(g.D), store)
    agent = DeviceAgent("late0", BrokerConfig.from_url(broker.url), {"scaffold.head": handler}, topics=topics,
                        aggregator_key=aggregator.public_key_bytes, state=store).start()

    publisher = raw_client(broker)
    busy, release = threading.Event(), threading.Event()
    try:
        assert wait_for(lambda: agent.online)
        time.sleep(0.5)                 # subscribed (the broker answers the connect first)
        holder = threading.Thread(target=lambda: agent.loop.call(lambda: busy.set() or release.wait(20), 25))
        holder.start()
        assert busy.wait(10)
        publisher.publish(topics.job_ends, encode(job_ended_message(AGGREGATOR_ID, [JobEnded(job, RUN_A, "done")]),
                                                  signer=aggregator.sign), qos=1).wait_for_publish(5)
        publisher.publish(topics.inbox("late0"), scaffold_task(aggregator, job, RUN_A, 2), qos=1).wait_for_publish(5)
        assert wait_for(lambda: len(agent.loop._queued) == 2), agent.loop._queued     # both wait, notice first
        release.set()
        holder.join(10)
        assert wait_for(lambda: agent.stats.tasks_skipped + agent.stats.tasks_done >= 1)
        time.sleep(0.3)
        assert (agent.stats.tasks_skipped, agent.stats.tasks_done, store.jobs()) == (1, 0, []), \
            (agent.stats, store.jobs())
        # the job id reused: another run, which runs
        publisher.publish(topics.inbox("late0"), scaffold_task(aggregator, job, RUN_B, 1), qos=1).wait_for_publish(5)
        assert wait_for(lambda: agent.stats.tasks_done == 1), agent.stats
        assert store.load(job, RUN_B) is not None
    finally:
        release.set()
        agent.stop()
        publisher.publish(topics.job_ends, b"", qos=1, retain=True).wait_for_publish(5)
        publisher.loop_stop()


def test_a_java_stateful_task_of_a_run_whose_end_it_handled_is_skipped_and_writes_nothing(java_cp, broker, tmp_path):
    """The Java device (HeadlessDevices over mosquitto) handles ``job.ended`` for the run it holds,
    then gets a late task of that run: skipped with its reason, no state written again (it was);
    a task of another job runs and keeps its state. One agent thread takes its inbox in order, so
    once that job's state is there the late task was handled."""
    import subprocess

    import java_build
    from test_aggregator_over_mqtt import raw_client
    from test_java_device import write_features

    from edge_client import golden_training as g
    from edge_client.state import DeviceStateStore

    topics, job = Topics("javalateend"), "scaffold-late"
    aggregator = DeviceIdentity.generate(AGGREGATOR_ID)
    store = DeviceStateStore(tmp_path / "state" / "java0")
    store.save(job, RUN_A, 1, {"c": np.ones(3, np.float32)})        # what its round 1 left
    feats = write_features(tmp_path / "f.feat", *g.features())
    jvm = subprocess.Popen(java_build.java_command(
        "-cp", java_cp, "org.fedfleet.device.HeadlessDevices", "--stop-on-stdin-eof", "--broker", broker.url,
        "--root", topics.root, "--aggregator-key", aggregator.public_key_bytes.hex(), "--tick", "0.1",
        "--state-dir", str(tmp_path / "state"), "--device", "java0", str(feats), "-"),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    publisher = raw_client(broker)
    try:
        publisher.publish(topics.job_ends, encode(job_ended_message(AGGREGATOR_ID, [JobEnded(job, RUN_A, "done")]),
                                                  signer=aggregator.sign), qos=1, retain=True).wait_for_publish(5)
        assert wait_for(lambda: store.jobs() == [], 30), "the Java device did not drop the ended run's state"
        publisher.publish(topics.inbox("java0"), scaffold_task(aggregator, job, RUN_A, 2), qos=1).wait_for_publish(5)
        later = scaffold_task(aggregator, "scaffold-next", RUN_B, 1)
        publisher.publish(topics.inbox("java0"), later, qos=1).wait_for_publish(5)
        assert wait_for(lambda: "scaffold-next" in store.jobs(), 30), "the Java device ran no task"
        assert store.jobs() == ["scaffold-next"]
    finally:
        publisher.publish(topics.job_ends, b"", qos=1, retain=True).wait_for_publish(5)
        publisher.loop_stop()
        out, err = jvm.communicate(timeout=30)
    assert "its job ended" in err, err[-3000:]
