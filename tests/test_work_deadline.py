"""A device stops a task's work once its round is surely over (edge_client/work_deadline.py, the Java
device's WorkDeadline.java): the local-training loops check the task's moment (its deadline plus the
clocks' grace) each step; the device declines the first such task of a job once (its clock may be
ahead), sends nothing for later ones, and is free for its next task. Before:
a task that arrived in time trained to its end however long that took, and its result was answered
``late``."""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest

import java_build
from edge_client.tasks.head_training import HeadTrainingTask
from edge_client.tasks.numpy_head import schedule
from edge_client.work_deadline import PastDeadline, working_until
from ops_fleet import wait_for
from protocols import messages as M
from protocols.envelope import decode, encode
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fedavg import HeadTrainingParams, LocalTraining, batch_schedule, head_tensors
from protocols.payloads.task_params import ModelSpec
from protocols.device_session import EXPIRED_AT_WORK_DECLINE
from protocols.topics import AGGREGATOR_ID, Topics
from test_agent_unsendable import Features, fed3r_params, handlers
from deployment_fleet import Sniffer
from test_java_device import write_features
from test_task_deadlines import AGG, answers

T = Topics()


def test_the_checked_schedule_takes_the_protocols_steps_and_stops_past_its_moment():
    steps = [b.tolist() for b in schedule(23, 3, 5, 7)]
    assert steps == [b.tolist() for b in batch_schedule(23, 3, 5, 7)]       # outside any task: unchecked
    with working_until(time.time() + 60):
        assert [b.tolist() for b in schedule(23, 3, 5, 7)] == steps
    with working_until(time.time() - 1), pytest.raises(PastDeadline, match="deadline passed during the work"):
        next(iter(schedule(23, 3, 5, 7)))


def test_a_device_stops_training_when_the_round_is_over_and_takes_the_next_task(broker):
    from edge_client.agent import DeviceAgent

    rng = np.random.default_rng(0)
    images, labels = rng.normal(size=(200, 16)), rng.integers(0, 3, 200)
    work = {**handlers(), "fedavg.head": HeadTrainingTask(images, labels, lambda b, s, w: Features())}
    # 10^6 SGD steps of one row: a minute or more on this machine, were it not stopped
    long_recipe = HeadTrainingParams(ModelSpec(backbone="b", image_size=8, num_classes=3), feature_dim=16,
                                     training=LocalTraining(epochs=5000, batch_size=1)).to_params()
    sniffer = Sniffer(broker, [T.outbox("dev-wd"), T.presence("dev-wd")])
    agent = DeviceAgent("dev-wd", BrokerConfig(port=broker.port), work, tick_s=0.05).start()
    try:
        wait_for(lambda: sniffer.seen.get(T.presence("dev-wd")), what="the agent online")
        # arrives in time (its deadline + the 60 s grace is 1.5 s away), then outlasts its round
        long_task = M.task_message(AGGREGATOR_ID, "j", 1, "fedavg.head", long_recipe, time.time() - 58.5)
        long_task.tensors.update(head_tensors(np.zeros((3, 16)), np.zeros(3)))
        next_task = M.task_message(AGGREGATOR_ID, "k", 1, "fed3r.stats", fed3r_params(), time.time() + 60)
        started = time.monotonic()
        for msg in (long_task, next_task):
            sniffer.publish(T.inbox("dev-wd"), encode(msg))

        def answered(task_id):
            return [env for env in map(decode, list(sniffer.seen.get(T.outbox("dev-wd"), [])))
                    if env.type in (M.RESULT, M.DECLINE) and env.body["task"] == task_id]

        wait_for(lambda: answered(next_task.id), timeout=20, what="the next task answered")
        assert time.monotonic() - started < 20 and answered(next_task.id)[0].type == M.RESULT
        # the job's first stop is declined once (the device's clock may be ahead); redelivered, the
        # task is past its deadline and skipped silently (a later task answered shows it was read)
        last_task = M.task_message(AGGREGATOR_ID, "m", 1, "fed3r.stats", fed3r_params(), time.time() + 60)
        for msg in (long_task, last_task):
            sniffer.publish(T.inbox("dev-wd"), encode(msg))
        wait_for(lambda: answered(last_task.id), what="the last task answered")
        assert [(env.type, env.body["reason"]) for env in answered(long_task.id)] == [(M.DECLINE, EXPIRED_AT_WORK_DECLINE)]
        assert (agent.stats.tasks_stopped, agent.stats.tasks_declined, agent.stats.tasks_skipped,
                agent.stats.tasks_done) == (1, 1, 1, 2)
    finally:
        agent.stop()
        sniffer.close()


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_the_java_device_stops_training_when_the_round_is_over(broker, tmp_path):
    """The same on the Java device (WorkDeadline.java: LocalTraining's schedule checks the moment
    MqttAgent sets around each handler): the long task is stopped, declined once for its job (the
    clock may be ahead), counted ``stopped=1``, and the next task is answered at once."""
    dev = "java-wd"
    rng = np.random.default_rng(1)
    dim, classes, rows = 2048, 8, 100
    features = write_features(tmp_path / "f.feat", rng.normal(size=(rows, dim)).astype(np.float32),
                              rng.integers(0, classes, rows))
    head = {"weight": np.zeros((classes, dim), np.float32), "bias": np.zeros(classes, np.float32)}
    recipe = {"num_classes": classes, "feature_dim": dim, "backbone": "b", "image_size": 8, "weights_sha256": "",
              "batch_size": 1, "lr": 0.01, "seed": 1}
    sniffer = Sniffer(broker, [T.outbox(dev)])
    jvm = subprocess.Popen(java_build.java_command("-cp", java_build.built(), "org.fedfleet.device.HeadlessDevices",
                                                   "--stop-on-stdin-eof", "--broker", broker.url, "--aggregator-key",
                                                   AGG.public_key_bytes.hex(), "--tick", "0.05", "--device", dev,
                                                   str(features), os.urandom(32).hex()),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert jvm.stdout.readline().strip() == f"ONLINE {dev}"
        # 10^6 one-row SGD steps on a (8, 2048) head: some 40 s of this machine's JVM, were it not
        # stopped; it arrives in time (its deadline + the 60 s grace is 2 s away), then outlasts its round
        long_task = M.task_message(AGGREGATOR_ID, "j", 1, "fedavg.head", {**recipe, "epochs": 10_000}, time.time() - 58)
        long_task.tensors.update(head)
        next_task = M.task_message(AGGREGATOR_ID, "k", 1, "fedavg.head", {**recipe, "epochs": 1, "batch_size": 50},
                                   time.time() + 60)
        next_task.tensors.update(head)
        started = time.monotonic()
        for msg in (long_task, next_task):
            sniffer.publish(T.inbox(dev), encode(msg, signer=AGG.sign))
        wait_for(lambda: answers(sniffer, dev, next_task.id), timeout=20, what="the next task answered")
        assert time.monotonic() - started < 10 and answers(sniffer, dev, next_task.id)[0].type == M.RESULT
        last_task = M.task_message(AGGREGATOR_ID, "m", 1, "fedavg.head", {**recipe, "epochs": 1, "batch_size": 50},
                                   time.time() + 60)
        last_task.tensors.update(head)
        for msg in (long_task, last_task):           # redelivered past its deadline: skipped silently
            sniffer.publish(T.inbox(dev), encode(msg, signer=AGG.sign))
        wait_for(lambda: answers(sniffer, dev, last_task.id), what="the last task answered")
    finally:
        out, err = jvm.communicate(timeout=30)
        sniffer.close()
    assert [(env.type, env.body["reason"]) for env in answers(sniffer, dev, long_task.id)] == \
        [(M.DECLINE, EXPIRED_AT_WORK_DECLINE)]
    assert f"STATS {dev} done=2 declined=1 " in out and " skipped=1 stopped=1" in out, (out, err[-3000:])
    assert err.count("stopped task") == 1 and "its deadline passed during the work" in err, err[-3000:]
