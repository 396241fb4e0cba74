"""A device runs a task only while its round may be open (docs/protocol.md, "Round rules"), the
Python device and the Java device alike, over a real mosquitto, every task signed by the
aggregator's key: a task received past its deadline (plus the clocks' grace) and a captured task
of an earlier round re-published while a later round's result awaits its ack are neither run nor
answered, and that result keeps being re-sent under its id (before: the replayed task started
afresh, was answered, and the waiting result lost its retries); a task of the next round runs."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

import java_build
from ops_fleet import wait_for
from protocols import messages as M
from protocols.envelope import decode, encode
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.topics import AGGREGATOR_ID, Topics
from test_agent_unsendable import fed3r_params, handlers
from test_deployment_attacks import Sniffer
from test_java_device import fleet_data, write_features

T = Topics()
AGG = DeviceIdentity.generate(AGGREGATOR_ID)


def answers(sniffer: Sniffer, device: str, task_id: str) -> list:
    """The device's results and declines to the task ``task_id``, in the order seen."""
    return [env for env in map(decode, list(sniffer.seen.get(T.outbox(device), [])))
            if env.type in (M.RESULT, M.DECLINE) and env.body["task"] == task_id]


def replay_and_expiry(sniffer: Sniffer, device: str, params: dict) -> None:
    now = time.time()

    def task(round_: int, deadline: float) -> tuple[str, bytes]:
        msg = M.task_message(AGGREGATOR_ID, "j", round_, "fed3r.stats", params, deadline)
        return msg.id, encode(msg, signer=AGG.sign)

    replayed_id, replayed = task(1, now + 30)       # captured in round 1, re-published in round 2
    current_id, current = task(2, now + 60)
    expired_id, expired = task(3, now - 120)        # 60 s past its deadline and the 60 s grace
    sniffer.publish(T.inbox(device), current)
    wait_for(lambda: answers(sniffer, device, current_id), what="round 2's result")
    sniffer.publish(T.inbox(device), replayed)
    sniffer.publish(T.inbox(device), expired)
    sent = len(answers(sniffer, device, current_id))
    # no aggregator acks it: round 2's result is re-sent, the same message, after the replay
    wait_for(lambda: len(answers(sniffer, device, current_id)) >= sent + 2, what="round 2's result re-sent twice more")
    got = answers(sniffer, device, current_id)
    assert {env.type for env in got} == {M.RESULT} and len({env.id for env in got}) == 1
    assert answers(sniffer, device, replayed_id) == [] and answers(sniffer, device, expired_id) == []
    next_id, next_task = task(4, time.time() + 60)
    sniffer.publish(T.inbox(device), next_task)
    wait_for(lambda: answers(sniffer, device, next_id), what="round 4's result")
    assert answers(sniffer, device, next_id)[0].type == M.RESULT
    assert answers(sniffer, device, replayed_id) == [] and answers(sniffer, device, expired_id) == []


def test_the_python_device_skips_expired_and_replayed_tasks(broker):
    from edge_client.agent import DeviceAgent

    sniffer = Sniffer(broker, [T.outbox("dev-py"), T.presence("dev-py")])
    agent = DeviceAgent("dev-py", BrokerConfig(port=broker.port), handlers(), retry_after_s=0.3, tick_s=0.05,
                        aggregator_key=AGG.public_key_bytes).start()
    try:
        wait_for(lambda: any(decode(p).body.get("state") == "online" for p in sniffer.seen.get(T.presence("dev-py"), [])),
                 what="the agent online")
        replay_and_expiry(sniffer, "dev-py", fed3r_params())
        assert agent.stats.tasks_skipped == 2 and agent.stats.tasks_done == 2 and agent.stats.tasks_declined == 0
    finally:
        agent.stop()
        sniffer.close()


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_the_java_device_skips_expired_and_replayed_tasks(broker, tmp_path):
    dev = "java-dl"
    features = write_features(tmp_path / "f.feat", *fleet_data(0))
    sniffer = Sniffer(broker, [T.outbox(dev)])
    jvm = subprocess.Popen(["java", "-cp", java_build.built(), "org.fedfleet.device.HeadlessDevices",
                            "--stop-on-stdin-eof", "--broker", broker.url, "--aggregator-key", AGG.public_key_bytes.hex(),
                            "--retry-after", "0.3", "--tick", "0.05", "--device", dev, str(features), os.urandom(32).hex()],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert jvm.stdout.readline().strip() == f"ONLINE {dev}"
        replay_and_expiry(sniffer, dev, {"num_classes": 3, "backbone": "b", "image_size": 8, "weights_sha256": "",
                                         "fit_intercept": True, "random_features": None, "format": "sparse",
                                         "dtype": "float64"})
    finally:
        out, err = jvm.communicate(timeout=30)
        sniffer.close()
    assert f"STATS {dev} done=2 declined=0 " in out and " skipped=2" in out, (out, err[-3000:])
    assert err.count("skipped task") == 2, err[-3000:]
