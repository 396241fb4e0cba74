"""Devices against hostile tasks over a real mosquitto (a device-side attack review's findings):
whatever a task's numbers, a device answers it with one clear decline and answers the next task.

* A ``fed3r.stats`` task naming a million classes (within ModelSpec's range) made the Java device
  allocate the class sums before any check: OutOfMemoryError, an Error its agent's loop did not
  catch, ended the agent's thread, and the device stayed online answering nothing. The Java device
  now declines such a task by the Python device's memory budget (the same words), and a task that
  still outgrows its heap is declined instead of ending the thread.
* A device of a secure job answered the same training asked in the clear (a plain ``fedavg.head``
  or ``fed3r.stats`` task, signed by the aggregator like any other), sending its update or
  statistics whole: secure aggregation hid nothing from an aggregator that turned against its
  fleet. Run secure-only (``fedfleet device --secure-only``, HeadlessDevices ``--secure-only``),
  both devices decline every kind that would send them in the clear, with the same words, and
  keep serving the secure kinds (``tests/test_java_device.py``'s secure fleet runs so).
* The Python agent kept secure task kinds and protocol message types in one table: a task of kind
  ``secagg`` reached the session registry (no ``on_task``), a message typed as a secure kind a
  declining handler (no ``on_message``), each an unexpected error logged with a traceback. The
  task is now an unsupported kind, in the Java device's words, and the message an ignored type.
* The Java deployment follower kept every refusal's reason for the process's life, whole: each
  message anyone published on its deploy topic added up to 64 KB (a schema error quotes the forged
  field). It keeps the latest KEPT_REFUSALS, each cut to MAX_WHY_CHARS, as the Python follower does.
* Both agents logged a rejected result's reason whole (60,000 characters an ack), and the Java agent
  what a malformed message's refusal quoted: now each line holds at most MAX_REASON_CHARS of it.
"""

from __future__ import annotations

import logging
import re
import struct
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import java_build
from edge_client.agent import DeviceAgent
from edge_client.handlers import Unsupported, secure_handlers, secure_only
from edge_client.tasks.secure_update import SecAggSessions
from edge_client.tasks.head_training import HeadTrainingTask
from edge_client.tasks.secure_fed3r import SecureFed3R
from protocols.identity import DeviceIdentity
from protocols.payloads.fedavg import HeadTrainingParams
from protocols.payloads.secagg import SECAGG_TYPE, SYNC_KIND
from protocols.payloads.task_kinds import SECURE_ONLY_DECLINE, UPDATES_IN_THE_CLEAR
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from ops_fleet import wait_for
from protocols import messages as M
from protocols.envelope import decode, encode
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fed3r import Fed3RStatsParams
from protocols.payloads.task_params import ModelSpec
from protocols.topics import AGGREGATOR_ID, Topics
from test_agent_unsendable import answers
from deployment_fleet import Sniffer

T = Topics()
D = 64                          # the devices' feature dimension


class Features:
    feature_dim = D

    def extract(self, images):
        return np.asarray(images, dtype=np.float64)


def write_features(path: Path, Z: np.ndarray, y: np.ndarray) -> Path:
    """The Java device's FeatureFile: int32 n, int32 d, n·d float32, n int32 labels (little-endian)."""
    path.write_bytes(struct.pack("<ii", *Z.shape) + Z.astype("<f4").tobytes() + y.astype("<i4").tobytes())
    return path


def java_devices(broker, *args: str) -> subprocess.Popen:
    return subprocess.Popen(java_build.java_command("-Xmx128m", "-cp", java_build.built(),
                                                    "org.fedfleet.device.HeadlessDevices", "--stop-on-stdin-eof",
                                                    "--broker", broker.url, "--tick", "0.1", *args),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def local_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(6, D)).astype(np.float32), np.array([0, 1, 2, 0, 1, 2])


def fed3r_task(num_classes: int, round_: int) -> M.Envelope:
    params = Fed3RStatsParams(model=ModelSpec(backbone="precomputed", image_size=1, num_classes=num_classes),
                              format="dense").to_params()
    return M.task_message(AGGREGATOR_ID, "hostile", round_, "fed3r.stats", params, time.time() + 120)


def online(sniffer: Sniffer, device: str) -> bool:
    return any(decode(p).body.get("state") == "online" for p in sniffer.seen.get(T.presence(device), []))


def ask(sniffer: Sniffer, device: str, task: M.Envelope, timeout: float = 60.0, signer=None):
    sniffer.publish(T.inbox(device), encode(task, signer=signer))
    wait_for(lambda: task.id in answers(sniffer, device), timeout=timeout, what=f"{device}'s answer to {task.body}")
    return answers(sniffer, device)[task.id]


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_a_fed3r_task_of_a_million_classes_is_declined_and_the_java_device_answers_on(broker, tmp_path: Path):
    Z, y = local_data()
    feats = write_features(tmp_path / "java0.feat", Z, y)
    sniffer = Sniffer(broker, [T.outbox("java0"), T.presence("java0"), T.outbox("py0"), T.presence("py0")])
    # a small heap, as a board or a gateway gives its device: a task within every params check still
    # outgrows it (one of 200,000 classes: the class sums and their wire copy, 210 MB)
    jvm = java_devices(broker, "--device", "java0", str(feats), "-")
    python = DeviceAgent("py0", BrokerConfig(port=broker.port),
                         {"fed3r.stats": Fed3RStatsTask(Z, y, lambda b, s, w: Features())}, tick_s=0.05).start()
    try:
        wait_for(lambda: online(sniffer, "java0") and online(sniffer, "py0"), what="both devices online")
        million = fed3r_task(1_000_000, round_=1)
        by_java, by_python = ask(sniffer, "java0", million), ask(sniffer, "py0", million)
        assert by_java.type == by_python.type == M.DECLINE
        # the same rule, the same words: 8 bytes for each of A (p x p), B (C x p) and the rows' one-hot labels
        p = D + 1
        mib = 8 * (p * p + 1_000_000 * p + len(y) * 1_000_000) / 2**20
        assert by_java.body["reason"] == by_python.body["reason"] == \
            f"statistics of {p} features need {mib:.0f} MiB, over this device's 256 MiB"
        heap = ask(sniffer, "java0", fed3r_task(200_000, round_=2))      # within the budget, past the heap
        assert heap.type == M.DECLINE and "OutOfMemoryError" in heap.body["reason"], heap.body
        honest = ask(sniffer, "java0", fed3r_task(3, round_=3))
        assert honest.type == M.RESULT and honest.body["n"] == len(y), honest.body
        assert np.allclose(honest.tensors["b"], ask(sniffer, "py0", fed3r_task(3, round_=3)).tensors["b"])
    finally:
        python.stop()
        out, err = jvm.communicate(timeout=60)
        sniffer.close()
    assert "STATS java0 done=1 declined=2 " in out, (out, err[-3000:])


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_secure_only_devices_decline_every_task_that_would_send_their_update_in_the_clear(broker, tmp_path: Path):
    Z, y = local_data()
    agg, seed = DeviceIdentity.generate("aggregator"), bytes(range(32))
    sniffer = Sniffer(broker, [T.outbox("java0"), T.presence("java0"), T.outbox("py0"), T.presence("py0")])
    jvm = java_devices(broker, "--aggregator-key", agg.public_key_bytes.hex(), "--secure-only",
                       "--device", "java0", str(write_features(tmp_path / "java0.feat", Z, y)), seed.hex())
    key = DeviceIdentity.generate("py0")
    plain = {"fed3r.stats": Fed3RStatsTask(Z, y, lambda b, s, w: Features()),
             "fedavg.head": HeadTrainingTask(Z, y, lambda b, s, w: Features())}
    protocol = secure_handlers(key, agg.public_key_bytes, plain)
    python = DeviceAgent("py0", BrokerConfig(port=broker.port), secure_only(plain), protocol_handlers=protocol,
                         signer=key.sign, aggregator_key=agg.public_key_bytes, tick_s=0.05).start()
    # the secure kinds still run the device's own training: secure_only replaced only what the agent answers
    assert isinstance(protocol[SYNC_KIND], SecureFed3R) and protocol[SYNC_KIND].stats is plain["fed3r.stats"]
    head = HeadTrainingParams(model=ModelSpec(backbone="precomputed", image_size=1, num_classes=3), feature_dim=D)
    rng = np.random.default_rng(1)
    tensors = {"weight": rng.normal(size=(3, D)).astype(np.float32), "bias": np.zeros(3, np.float32)}
    try:
        wait_for(lambda: online(sniffer, "java0") and online(sniffer, "py0"), what="both devices online")
        java_kinds = next(decode(p).body["info"]["kinds"] for p in sniffer.seen[T.presence("java0")]
                          if decode(p).body.get("state") == "online")
        assert {"fed3r.secure", "fedavg.secure"} <= set(java_kinds)
        for round_, task in enumerate([fed3r_task(3, round_=1),
                                       M.task_message(AGGREGATOR_ID, "hostile", 2, "fedavg.head", head.to_params(),
                                                      time.time() + 120)], start=1):
            task.tensors = tensors if task.body["kind"] == "fedavg.head" else {}
            for device in ("java0", "py0"):
                answer = ask(sniffer, device, task, signer=agg.sign)
                assert answer.type == M.DECLINE and not answer.tensors, (device, answer.body)
                assert answer.body["reason"] == SECURE_ONLY_DECLINE.format(kind=task.body["kind"]), answer.body
    finally:
        python.stop()
        out, err = jvm.communicate(timeout=60)
        sniffer.close()
    assert "STATS java0 done=0 declined=2 " in out, (out, err[-3000:])
    assert "fed3r.stats" in UPDATES_IN_THE_CLEAR and "oll.personalize" not in UPDATES_IN_THE_CLEAR


def test_the_java_device_declines_the_same_kinds_in_the_clear_as_the_python_device():
    source = (java_build.LIBRARY / "org" / "fedfleet" / "device" / "SecureOnly.java").read_text()
    listed = source.split("UPDATES_IN_THE_CLEAR = Set.of(", 1)[1].split(")", 1)[0]
    assert set(re.findall(r'"([^"]+)"', listed)) == UPDATES_IN_THE_CLEAR


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_a_task_of_a_message_type_and_a_message_of_a_task_kind_are_one_clear_refusal(broker, tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="fedfleet.device")
    Z, y = local_data()
    sniffer = Sniffer(broker, [T.outbox("java0"), T.presence("java0"), T.outbox("py0"), T.presence("py0")])
    jvm = java_devices(broker, "--device", "java0", str(write_features(tmp_path / "java0.feat", Z, y)), "-")
    protocol = {SYNC_KIND: Unsupported("no secure Fed3R here"), SECAGG_TYPE: SecAggSessions("py0")}
    python = DeviceAgent("py0", BrokerConfig(port=broker.port),
                         {"fed3r.stats": Fed3RStatsTask(Z, y, lambda b, s, w: Features())},
                         protocol_handlers=protocol, tick_s=0.05).start()
    try:
        wait_for(lambda: online(sniffer, "java0") and online(sniffer, "py0"), what="both devices online")
        task = M.task_message(AGGREGATOR_ID, "hostile", 1, SECAGG_TYPE, {}, time.time() + 120)
        for device in ("java0", "py0"):
            answer = ask(sniffer, device, task)
            assert answer.type == M.DECLINE and answer.body["reason"] == "unsupported task kind 'secagg'", answer.body
        sniffer.publish(T.inbox("py0"), encode(M.Envelope(type=SYNC_KIND, sender=AGGREGATOR_ID, body={})))
        honest = ask(sniffer, "py0", fed3r_task(3, round_=2))       # after the message: it was taken and dropped
        assert honest.type == M.RESULT
    finally:
        python.stop()
        jvm.communicate(timeout=60)
        sniffer.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert any("ignoring message type fed3r.secure" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_the_java_follower_keeps_the_latest_refusals_of_a_flood_each_cut(broker, tmp_path: Path):
    from edge_client.deployment import KEPT_REFUSALS, MAX_WHY_CHARS

    Z, y = local_data()
    topics = Topics(f"f{time.monotonic_ns()}")
    proc = subprocess.Popen(java_build.java_command("-cp", java_build.built(), "FollowerRunner", broker.url, "jcam",
                                                    topics.root, "-", str(tmp_path / "slot"),
                                                    str(write_features(tmp_path / "held.feat", Z, y))),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logged: list[str] = []
    reader = threading.Thread(target=lambda: logged.extend(proc.stderr), daemon=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        reader.start()
        sniffer = Sniffer(broker, [])
        junk = encode(M.Envelope(type="x" * 60_000, sender=AGGREGATOR_ID, body={}))

        def refused() -> int:
            return sum("assignment refused" in line for line in logged)

        wait_for(lambda: sniffer.publish(topics.deploy("jcam"), junk) or refused() > 0,    # subscribed by now
                 what="the follower subscribed")
        time.sleep(0.5)                 # the subscription's redeliveries, if any, counted before the flood
        first = refused()
        for _ in range(KEPT_REFUSALS + 20):
            sniffer.client.publish(topics.deploy("jcam"), junk, qos=1)
        wait_for(lambda: refused() >= KEPT_REFUSALS + 20 + first, timeout=60, what="the junk refused")
        sniffer.close()
        out, _ = proc.communicate("", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"REFUSALS {KEPT_REFUSALS}" in out, out
    refused = [line for line in logged if "assignment refused" in line]
    assert max(map(len, refused)) <= MAX_WHY_CHARS + 100, max(map(len, refused))     # the log line's prefix


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_a_rejection_reason_of_any_length_is_logged_cut_by_both_agents(broker, tmp_path: Path, caplog):
    from edge_client.agent import MAX_REASON_CHARS

    Z, y = local_data()
    sniffer = Sniffer(broker, [T.presence("java0"), T.presence("py0")])
    jvm = java_devices(broker, "--device", "java0", str(write_features(tmp_path / "java0.feat", Z, y)), "-")
    python = DeviceAgent("py0", BrokerConfig(port=broker.port), {}, tick_s=0.05).start()
    ack = encode(M.ack_message(AGGREGATOR_ID, "r" * 32, "rejected", "y" * 60_000))
    try:
        wait_for(lambda: online(sniffer, "java0") and online(sniffer, "py0"), what="both devices online")
        for device in ("java0", "py0"):
            sniffer.publish(T.inbox(device), ack)
        wait_for(lambda: any("rejected" in r.getMessage() for r in caplog.records), what="py0's line")
        time.sleep(1.0)
    finally:
        python.stop()
        _, err = jvm.communicate(timeout=60)
        sniffer.close()
    lines = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()] + \
        [line for line in err.splitlines() if "rejected" in line]
    assert len(lines) == 2 and all("y" * MAX_REASON_CHARS in line for line in lines), [len(x) for x in lines]
    assert max(map(len, lines)) < MAX_REASON_CHARS + 100, [len(x) for x in lines]
