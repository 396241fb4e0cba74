"""A device runs a task only while its round may be open (docs/protocol.md, "Round rules"), the
Python device and the Java device alike, over a real mosquitto, every task signed by the
aggregator's key: captured tasks (of the job at work, or of another job) re-published while a
later result awaits its ack are neither run nor answered, and that result keeps being re-sent
under its id (before: the replayed task started afresh, was answered, and the waiting result lost
its retries); a task naming another device (captured on its inbox) is skipped, one whose addressee
is no string dropped as malformed; a task received past its deadline (plus the clocks' grace) is declined once for its
job, saying the device's clock may be ahead, then skipped; a job re-created under the same id
(its tasks created later) runs, and so does the next round."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

import java_build
from ops_fleet import wait_for
from protocols import messages as M
from protocols.envelope import EnvelopeError, decode, encode
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.topics import AGGREGATOR_ID, Topics
from test_agent_unsendable import fed3r_params, handlers
from deployment_fleet import Sniffer
from test_java_device import fleet_data, write_features

T = Topics()
AGG = DeviceIdentity.generate(AGGREGATOR_ID)
JAVA_FED3R_PARAMS = {"num_classes": 3, "backbone": "b", "image_size": 8, "weights_sha256": "", "fit_intercept": True,
                     "random_features": None, "format": "sparse", "dtype": "float64"}


def answers(sniffer: Sniffer, device: str, task_id: str) -> list:
    """The device's results and declines to the task ``task_id``, in the order seen."""
    return [env for env in map(decode, list(sniffer.seen.get(T.outbox(device), [])))
            if env.type in (M.RESULT, M.DECLINE) and env.body["task"] == task_id]


def replay_and_expiry(sniffer: Sniffer, device: str, params: dict) -> None:
    now = time.time()

    def task(job: str, round_: int, deadline: float, to: str | None = None) -> tuple[str, bytes]:
        msg = M.task_message(AGGREGATOR_ID, job, round_, "fed3r.stats", params, deadline, device=to)
        return msg.id, encode(msg, signer=AGG.sign)

    def result_of(task_id: str) -> None:
        wait_for(lambda: answers(sniffer, device, task_id), what=f"the answer to {task_id}")
        assert answers(sniffer, device, task_id)[0].type == M.RESULT

    # captured earlier (created first): job a's round 4 and job j's round 1, re-published later
    captured_a_id, captured_a = task("a", 4, now + 60)
    replayed_id, replayed = task("j", 1, now + 30)
    a_id, a_task = task("a", 5, now + 60)
    sniffer.publish(T.inbox(device), a_task)
    result_of(a_id)
    current_id, current = task("j", 2, now + 60, to=device)
    elsewhere_id, elsewhere = task("j", 2, now + 60, to="another-device")    # captured on its inbox
    bad = M.task_message(AGGREGATOR_ID, "j", 5, "fed3r.stats", params, now + 60)
    bad.body["device"] = 123                            # not a device id: the task is malformed, refused
    bad_id, bad_task = bad.id, encode(bad, signer=AGG.sign)
    expired_id, expired = task("j", 3, now - 120)        # 60 s past its deadline and the 60 s grace
    sniffer.publish(T.inbox(device), current)
    result_of(current_id)
    for payload in (replayed, captured_a, elsewhere, bad_task, expired, expired):
        sniffer.publish(T.inbox(device), payload)
    sent = len(answers(sniffer, device, current_id))
    # no aggregator acks it: round 2's result is re-sent, the same message, after the replays
    wait_for(lambda: len(answers(sniffer, device, current_id)) >= sent + 2, what="round 2's result re-sent twice more")
    got = answers(sniffer, device, current_id)
    assert {env.type for env in got} == {M.RESULT} and len({env.id for env in got}) == 1
    assert answers(sniffer, device, replayed_id) == answers(sniffer, device, captured_a_id) == []
    assert answers(sniffer, device, elsewhere_id) == answers(sniffer, device, bad_id) == []
    # the expired task: declined once for its job (the device's clock may be ahead), then skipped
    declined = answers(sniffer, device, expired_id)
    assert [env.type for env in declined] == [M.DECLINE] and "is the clock ahead?" in declined[0].body["reason"]
    # job a re-created under the same id: its round 1, created now, runs; so does job j's next round
    again_id, again = task("a", 1, time.time() + 60)
    sniffer.publish(T.inbox(device), again)
    result_of(again_id)
    next_id, next_task = task("j", 4, time.time() + 60, to=device)
    sniffer.publish(T.inbox(device), next_task)
    result_of(next_id)
    assert answers(sniffer, device, replayed_id) == answers(sniffer, device, captured_a_id) == []
    assert len(answers(sniffer, device, expired_id)) == 1


def replay_after_answers_pushed_out(sniffer: Sniffer, device: str, params: dict) -> None:
    """A device keeps its last 4 answers. Job p's task answered, then tasks of 4 other jobs, then
    p's captured task re-published (the same signed bytes, within its deadline): skipped. Before (a
    review's finding), it ran again: the work and a second, fresh result. The aggregator's re-send
    of it (a new envelope, the same task id, signed later) runs: the device has no answer left."""
    now = time.time()

    def answered(msg) -> set:
        """The distinct messages answering ``msg`` (a result is retried under its id: no ack here)."""
        return {env.id for env in answers(sniffer, device, msg.id)}

    def run(msg) -> None:
        sniffer.publish(T.inbox(device), encode(msg, signer=AGG.sign))
        wait_for(lambda: answers(sniffer, device, msg.id), what=f"the answer to {msg.body['job']}")

    first = M.task_message(AGGREGATOR_ID, "p", 1, "fed3r.stats", params, now + 60, device=device)
    captured = encode(first, signer=AGG.sign)
    run(first)
    for job in ("q0", "q1", "q2", "q3"):       # p's answer pushed out of the 4 kept
        run(M.task_message(AGGREGATOR_ID, job, 1, "fed3r.stats", params, now + 60, device=device))
    sniffer.publish(T.inbox(device), captured)
    # the device works its inbox in order: had the replay run, its result came before this answer
    run(M.task_message(AGGREGATOR_ID, "q4", 1, "fed3r.stats", params, now + 60, device=device))
    assert len(answered(first)) == 1, "the replayed task ran again"
    resent = M.task_message(AGGREGATOR_ID, "p", 1, "fed3r.stats", params, now + 60, device=device)
    resent.id = first.id                       # as the aggregator re-sends: same id, a new envelope
    sniffer.publish(T.inbox(device), encode(resent, signer=AGG.sign))
    wait_for(lambda: len(answered(first)) == 2, what="the aggregator's re-send answered")


def test_the_python_device_skips_expired_and_replayed_tasks(broker):
    from edge_client.agent import DeviceAgent

    sniffer = Sniffer(broker, [T.outbox("dev-py"), T.presence("dev-py")])
    agent = DeviceAgent("dev-py", BrokerConfig(port=broker.port), handlers(), retry_after_s=0.3, tick_s=0.05,
                        aggregator_key=AGG.public_key_bytes).start()
    try:
        wait_for(lambda: any(decode(p).body.get("state") == "online" for p in sniffer.seen.get(T.presence("dev-py"), [])),
                 what="the agent online")
        replay_and_expiry(sniffer, "dev-py", fed3r_params())
        assert (agent.stats.tasks_skipped, agent.stats.tasks_done, agent.stats.tasks_declined) == (4, 4, 1)
        replay_after_answers_pushed_out(sniffer, "dev-py", fed3r_params())
        assert (agent.stats.tasks_skipped, agent.stats.tasks_done) == (5, 11)
        bad = M.task_message(AGGREGATOR_ID, "j", 1, "fed3r.stats", {}, 1.0)
        bad.body["device"] = 123                        # the refusal the malformed task above met
        with pytest.raises(EnvelopeError, match="'device' must be a string"):
            M.task_addressee(decode(encode(bad)))
    finally:
        agent.stop()
        sniffer.close()


def replays_across_a_restart(sniffer: Sniffer, device: str, params: dict, start, stop) -> None:
    """Tasks captured before a device's restart and re-published after it: skipped as before it
    (the device keeps its replay guard in its state folder), round 2's task too, answered before
    the restart (before, it ran again: answers are not kept across a restart); the aggregator's
    re-send of round 2 (a new envelope, signed later) and the next round run. ``start()`` brings
    the device up with the same state folder, ``stop()`` takes it down; the device is up when
    this is called."""
    now = time.time()

    def task(job: str, round_: int, deadline: float) -> tuple[str, bytes]:
        msg = M.task_message(AGGREGATOR_ID, job, round_, "fed3r.stats", params, deadline, device=device)
        return msg.id, encode(msg, signer=AGG.sign)

    def result_of(task_id: str) -> None:
        wait_for(lambda: answers(sniffer, device, task_id), what=f"the answer to {task_id}")
        assert answers(sniffer, device, task_id)[0].type == M.RESULT

    captured_id, captured = task("r", 1, now + 60)       # created first, captured, re-published later
    first_id, first = task("r", 1, now + 60)
    current_id, current = task("r", 2, now + 60)
    expired_id, expired = task("x", 1, now - 120)
    for task_id, payload in ((first_id, first), (current_id, current)):
        sniffer.publish(T.inbox(device), payload)
        result_of(task_id)
    sniffer.publish(T.inbox(device), expired)
    wait_for(lambda: answers(sniffer, device, expired_id), what="the expired task declined")
    stop()
    start()
    again_id, again = task("x", 2, now - 120)            # the job was told once already: skipped, not declined
    answered_before = {env.id for env in answers(sniffer, device, current_id)}
    for payload in (captured, first, expired, again, current):
        sniffer.publish(T.inbox(device), payload)
    resent = M.task_message(AGGREGATOR_ID, "r", 2, "fed3r.stats", params, now + 60, device=device)
    resent.id = current_id                               # the aggregator's re-send: its round still waits
    sniffer.publish(T.inbox(device), encode(resent, signer=AGG.sign))
    wait_for(lambda: len({env.id for env in answers(sniffer, device, current_id)}) >= 2,
             what="round 2's re-send answered after the restart")
    # one new result (the stats say the replay was skipped, not run with the re-send ignored as work under way)
    assert len({env.id for env in answers(sniffer, device, current_id)} - answered_before) == 1
    next_id, next_task = task("r", 3, time.time() + 60)
    sniffer.publish(T.inbox(device), next_task)
    result_of(next_id)
    assert answers(sniffer, device, captured_id) == [] and len(answers(sniffer, device, first_id)) == 1
    assert len(answers(sniffer, device, expired_id)) == 1 and answers(sniffer, device, again_id) == []


def test_a_restarted_python_device_still_skips_replays(broker, tmp_path, caplog):
    """Before: the guard lived in memory, and the restarted device ran and answered the replays."""
    from edge_client.agent import DeviceAgent
    from edge_client.session_memory import SESSION_FILE
    from edge_client.state import DeviceStateStore

    sniffer = Sniffer(broker, [T.outbox("dev-rs"), T.presence("dev-rs")])
    agents = []

    def start():
        agents.append(DeviceAgent("dev-rs", BrokerConfig(port=broker.port), handlers(), retry_after_s=0.3,
                                  tick_s=0.05, aggregator_key=AGG.public_key_bytes,
                                  state=DeviceStateStore(tmp_path / "state")).start())
        online = len(agents)
        wait_for(lambda: sum(decode(p).body.get("state") == "online"
                             for p in sniffer.seen.get(T.presence("dev-rs"), [])) >= online, what="the agent online")

    try:
        start()
        replays_across_a_restart(sniffer, "dev-rs", fed3r_params(), start, lambda: agents[-1].stop())
        assert (agents[1].stats.tasks_skipped, agents[1].stats.tasks_declined) == (5, 0)
        # a torn or edited memory: one warning, the device starts without it and works
        agents[-1].stop()
        (tmp_path / "state" / SESSION_FILE).write_text('{"version": 1, "started": [["r", 1, "t"]]')
        start()
        assert "session memory" in caplog.text and agents[-1].session.last_started == {}
        task_id, payload = (lambda m: (m.id, encode(m, signer=AGG.sign)))(M.task_message(
            AGGREGATOR_ID, "r", 9, "fed3r.stats", fed3r_params(), time.time() + 60, device="dev-rs"))
        sniffer.publish(T.inbox("dev-rs"), payload)
        wait_for(lambda: answers(sniffer, "dev-rs", task_id), what="a task run after the torn memory")
    finally:
        agents[-1].stop()
        sniffer.close()


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_the_java_device_skips_expired_and_replayed_tasks(broker, tmp_path):
    dev = "java-dl"
    features = write_features(tmp_path / "f.feat", *fleet_data(0))
    sniffer = Sniffer(broker, [T.outbox(dev)])
    jvm = subprocess.Popen(java_build.java_command("-cp", java_build.built(), "org.fedfleet.device.HeadlessDevices",
                                                   "--stop-on-stdin-eof", "--broker", broker.url, "--aggregator-key",
                                                   AGG.public_key_bytes.hex(), "--retry-after", "0.3", "--tick",
                                                   "0.05", "--device", dev, str(features), os.urandom(32).hex()),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert jvm.stdout.readline().strip() == f"ONLINE {dev}"
        replay_and_expiry(sniffer, dev, JAVA_FED3R_PARAMS)
        replay_after_answers_pushed_out(sniffer, dev, JAVA_FED3R_PARAMS)
    finally:
        out, err = jvm.communicate(timeout=30)
        sniffer.close()
    assert f"STATS {dev} done=11 declined=1 " in out and " skipped=5" in out, (out, err[-3000:])
    # once per (job, reason): (j, stale), (a, stale), (j, another addressee), (j, expired), (p, answered)
    assert err.count("skipped task") == 5, err[-3000:]


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_a_restarted_java_device_still_skips_replays(broker, tmp_path):
    """The Java device keeps its replay guard in session.json of its state folder too (before: in
    memory, and the restarted JVM ran and answered the replays). Its first start finds an edited
    memory there, one entry malformed: refused whole (one warning; else job r's tasks, older than the
    entry's ts, were skipped), and it works. Then the Python device, started on the folder the Java
    device wrote, skips a replay the Java device's memory names: they share the file's layout."""
    from edge_client.agent import DeviceAgent
    from edge_client.state import DeviceStateStore

    dev = "java-rs"
    folder = tmp_path / "state" / dev                    # HeadlessDevices keeps <--state-dir>/<id>
    folder.mkdir(parents=True)
    (folder / "session.json").write_text(json.dumps({"version": 1, "started": [["r", 9, "t9", 4e9], ["x", 1.0, "t", 1.0]],
                                                     "expired_declined": ["x"]}))
    features = write_features(tmp_path / "f.feat", *fleet_data(0))
    seed = os.urandom(32).hex()
    sniffer = Sniffer(broker, [T.outbox(dev), T.presence(dev)])
    early = M.task_message(AGGREGATOR_ID, "r", 1, "fed3r.stats", fed3r_params(), time.time() + 60, device=dev)
    jvms, outputs, agents = [], [], []

    def start():
        jvms.append(subprocess.Popen(java_build.java_command("-cp", java_build.built(),
                                                             "org.fedfleet.device.HeadlessDevices",
                                                             "--stop-on-stdin-eof", "--broker", broker.url,
                                                             "--aggregator-key", AGG.public_key_bytes.hex(),
                                                             "--retry-after", "0.3", "--tick", "0.05", "--state-dir",
                                                             str(tmp_path / "state"), "--device", dev, str(features),
                                                             seed),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        assert jvms[-1].stdout.readline().strip() == f"ONLINE {dev}"

    def stop():
        outputs.append(jvms[-1].communicate(timeout=30))     # stdin closed: the device says offline, prints STATS

    try:
        start()
        replays_across_a_restart(sniffer, dev, JAVA_FED3R_PARAMS, start, stop)
        stop()
        (first_out, first_err), (second_out, second_err) = outputs
        assert f"STATS {dev} done=2 declined=1 " in first_out and " skipped=0" in first_out, (first_out, first_err[-3000:])
        assert first_err.count("is unreadable") == 1 and "a started entry is not" in first_err, first_err[-3000:]
        assert f"STATS {dev} done=2 declined=0 " in second_out and " skipped=5" in second_out, (second_out, second_err[-3000:])
        assert "session memory" not in second_err, second_err[-3000:]
        written = json.loads((folder / "session.json").read_text())
        assert [entry[:2] for entry in written["started"]] == [["r", 3]] and written["expired_declined"] == ["x"]

        agents.append(DeviceAgent(dev, BrokerConfig(port=broker.port), handlers(), retry_after_s=0.3, tick_s=0.05,
                                  aggregator_key=AGG.public_key_bytes, state=DeviceStateStore(folder)).start())
        wait_for(lambda: sum(decode(p).body.get("state") == "online"
                             for p in sniffer.seen.get(T.presence(dev), [])) >= 3, what="the Python agent online")
        assert agents[0].session.memory() == written
        later = M.task_message(AGGREGATOR_ID, "r", 4, "fed3r.stats", fed3r_params(), time.time() + 60, device=dev)
        for msg in (early, later):                        # early: created before all the Java device ran
            sniffer.publish(T.inbox(dev), encode(msg, signer=AGG.sign))
        wait_for(lambda: answers(sniffer, dev, later.id), what="the Python device's answer to round 4")
        assert answers(sniffer, dev, early.id) == [] and agents[0].stats.tasks_skipped == 1
    finally:
        for jvm in jvms:
            if jvm.poll() is None:
                jvm.kill()
                jvm.wait()
        for agent in agents:
            agent.stop()
        sniffer.close()


def test_the_aggregator_names_each_tasks_device(broker, tmp_path):
    """Each task carries its addressee, signed with it (what the devices above check)."""
    from test_aggregator_over_mqtt import start_service

    devices = ["dev-x", "dev-y"]
    sniffer = Sniffer(broker, [T.inbox(d) for d in devices])
    svc, thread, _ = start_service(broker, tmp_path, devices)
    try:
        for d in devices:
            sniffer.publish(T.presence(d), encode(M.presence_message(d, "online", {"kinds": ["fed3r.stats"]})),
                            retain=True)

        def task_of(d):
            return next((env for env in map(decode, list(sniffer.seen.get(T.inbox(d), []))) if env.type == M.TASK), None)

        wait_for(lambda: all(task_of(d) for d in devices), what="a task on each device's inbox")
        assert [M.task_addressee(task_of(d)) for d in devices] == devices
    finally:
        svc.stop()
        thread.join(10)
        sniffer.close()
