"""The Java device's MQTT threads and what an application's code throws on them, over mosquitto
(``tests/java_device/FollowerRunner.java``, ``AgentSignerFails.java``), the policy of MqttAgent
(tests/test_java_agent_errors.py: any Throwable is the failure of the step in hand, except what
``MqttAgent.endsTheLoop`` names):

* ``DeploymentFollower``: an AssertionError from the application's held-out features is that
  adoption's failure, tried again (the head is adopted at the next try); an AssertionError from its
  signer (the head's ``artifact.get``) is that tick's, asked again. Its loop caught only
  RuntimeException: either ended the follower's thread in silence, the head never adopted. An
  InternalError (the JVM in doubt) stops it with one log line, the cause in ``stoppedBy()``;
* ``DeviceConnection.listen`` (MqttAgent's ``announce``, on the MQTT client's thread): a signer that
  throws on the presence is logged and the connection goes on; the agent handles its task. Thrown
  into the client (it caught only EnvelopeError), the error reached hawtdispatch's
  ``TcpTransport.drainInbound``, which printed it and failed the transport: the client dropped the
  connection and reconnected (and a signer that always throws made it reconnect for ever)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time

import numpy as np
import pytest

import java_build
from deployment_fleet import Sniffer
from ops_fleet import wait_for
from protocols import messages as M
from protocols.envelope import decode, encode
from protocols.identity import DeviceIdentity
from protocols.payloads import deployment as D
from protocols.payloads.artifacts import GET, artifact_message
from protocols.topics import AGGREGATOR_ID, Topics
from test_java_deployment import running
from test_java_device import write_features

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

C, DIM, N = 3, 4, 12
DEVICE = "jfollow"


def follower(broker, tmp_path, topics, key: DeviceIdentity, **env):
    rng = np.random.default_rng(1)
    feats = write_features(tmp_path / "held.bin", rng.normal(size=(N, DIM)).astype(np.float32),
                           rng.integers(0, C, N))
    proc = subprocess.Popen(java_build.java_command("-cp", java_build.built(), "FollowerRunner", broker.url, DEVICE,
                                                    topics.root, key.public_key_bytes.hex(), str(tmp_path / "slot"),
                                                    str(feats)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    assert proc.stdout.readline().strip() == "READY", proc.stderr.read()[-3000:]
    return proc


def deploy_one_head(broker, topics, key: DeviceIdentity, asks: int = 1) -> str:
    """A signed ``run`` of one head, the head sent once the device asked for it ``asks`` times; its sha256."""
    rng = np.random.default_rng(2)
    head = D.head_npz(rng.normal(size=(C, DIM)), rng.normal(size=C))
    sha = hashlib.sha256(head).hexdigest()
    sniffer = Sniffer(broker, [topics.deploy_out(DEVICE)])
    try:
        sniffer.publish(topics.deploy(DEVICE), encode(D.run_message(AGGREGATOR_ID, "d1", sha, len(head), 1,
                                                                    device=DEVICE, seq=1), signer=key.sign),
                        retain=True)        # as the controller's: whenever the device subscribes
        wait_for(lambda: sum(decode(p).type == GET for p in sniffer.seen.get(topics.deploy_out(DEVICE), [])) >= asks,
                 20.0, f"the head asked for {asks} time(s)")
        sniffer.publish(topics.deploy_in(DEVICE), encode(artifact_message(AGGREGATOR_ID, sha, "d1.npz", head),
                                                         signer=key.sign))
    finally:
        sniffer.publish(topics.deploy(DEVICE), b"", retain=True)
        sniffer.close()
    return sha


def ended(proc) -> tuple[dict[str, str], str]:
    out, err = proc.communicate("", timeout=30)
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines()}, err


@pytest.mark.parametrize("env, logged", [
    ({"FOLLOWER_FAILED_READS": "1", "FOLLOWER_READ_FAILURE": "assertion"},
     "not adopted yet (held-out features: AssertionError: the application's held-out features failed)"),
    ({"FOLLOWER_FAILED_SIGNS": "1"}, "unexpected error its tick; the follower goes on"),
])
def test_the_java_follower_takes_an_application_error_as_the_failure_of_the_step_in_hand(broker, tmp_path, env,
                                                                                        logged):
    topics, key = Topics(f"jf{time.monotonic_ns()}"), DeviceIdentity.generate(AGGREGATOR_ID)
    proc = follower(broker, tmp_path, topics, key, **env)
    try:
        # a failing signer: its first artifact.get is never sent; the head is sent once asked (again)
        sha = deploy_one_head(broker, topics, key)
        wait_for(lambda: running(tmp_path / "slot") == sha, 20.0, "the head adopted")
        printed, log = ended(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert printed["CURRENT"] == sha and printed["STOPPED"] == "-", (printed, log[-3000:])
    assert log.count(logged) == 1 and "AssertionError" in log, log[-3000:]
    assert "stopped" not in log, log[-3000:]


def test_the_java_follower_stops_cleanly_on_an_error_that_leaves_the_jvm_in_doubt(broker, tmp_path):
    topics, key = Topics(f"jf{time.monotonic_ns()}"), DeviceIdentity.generate(AGGREGATOR_ID)
    proc = follower(broker, tmp_path, topics, key, FOLLOWER_FAILED_READS="1", FOLLOWER_READ_FAILURE="internal")
    try:
        deploy_one_head(broker, topics, key)
        time.sleep(1.5)                 # the follower tries again every 0.5 s, had it gone on
        printed, log = ended(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert printed["CURRENT"] == "none" and printed["STOPPED"] == "java.lang.InternalError", (printed, log[-3000:])
    stopped = [line for line in log.splitlines() if "the deployment follower stopped" in line]
    assert len(stopped) == 1 and "InternalError: the JVM's own error" in stopped[0], log[-3000:]
    assert "DeploymentFollower.stoppedBy" in stopped[0]


def test_a_java_agent_whose_presence_cannot_be_signed_keeps_its_connection_and_handles_its_task(broker, tmp_path):
    topics, device = Topics(f"ja{time.monotonic_ns()}"), "jsigner"
    sniffer = Sniffer(broker, [topics.outbox(device)])
    proc = subprocess.Popen(java_build.java_command("-cp", java_build.built(), "AgentSignerFails", broker.url, device,
                                                    topics.root, "1"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()[-3000:]
        task = M.task_message(AGGREGATOR_ID, "echo-job", 1, "test.echo", {}, time.time() + 600, device=device)
        sniffer.publish(topics.inbox(device), encode(task), retain=True)    # whenever its subscription is granted
        wait_for(lambda: sniffer.seen.get(topics.outbox(device)), 20.0, "the task's result")
        time.sleep(1.0)                 # a dropped connection comes back within 0.2 s: time for it to show
        out, log = proc.communicate("", timeout=30)
    finally:
        sniffer.publish(topics.inbox(device), b"", retain=True)
        sniffer.close()
        if proc.poll() is None:
            proc.kill()
    result = decode(sniffer.seen[topics.outbox(device)][0])
    assert result.type == M.RESULT and result.body["job"] == "echo-job", result
    assert "STOPPED -" in out, (out, log[-3000:])
    assert log.count("unexpected error saying online") == 1 and "the connection goes on" in log, log[-3000:]
    # the connection was never dropped: its one loss is the close's own clean disconnect
    assert log.count("disconnected, reconnecting") == 1 and "connection failure" not in log, log[-3000:]
