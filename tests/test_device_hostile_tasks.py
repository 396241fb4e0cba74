"""Devices against hostile tasks over a real mosquitto (a device-side attack review's findings):
whatever a task's numbers, a device answers it with one clear decline and answers the next task.

* A ``fed3r.stats`` task naming a million classes (within ModelSpec's range) made the Java device
  allocate the class sums before any check: OutOfMemoryError, an Error its agent's loop did not
  catch, ended the agent's thread, and the device stayed online answering nothing. The Java device
  now declines such a task by the Python device's memory budget (the same words), and a task that
  still outgrows its heap is declined instead of ending the thread.
"""

from __future__ import annotations

import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import java_build
from edge_client.agent import DeviceAgent
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from ops_fleet import wait_for
from protocols import messages as M
from protocols.envelope import decode, encode
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fed3r import Fed3RStatsParams
from protocols.payloads.task_params import ModelSpec
from protocols.topics import AGGREGATOR_ID, Topics
from test_deployment_attacks import Sniffer

T = Topics()
D = 64                          # the devices' feature dimension


class Features:
    feature_dim = D

    def extract(self, images):
        return np.asarray(images, dtype=np.float64)


def local_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(6, D)).astype(np.float32), np.array([0, 1, 2, 0, 1, 2])


def fed3r_task(num_classes: int, round_: int) -> M.Envelope:
    params = Fed3RStatsParams(model=ModelSpec(backbone="precomputed", image_size=1, num_classes=num_classes),
                              format="dense").to_params()
    return M.task_message(AGGREGATOR_ID, "hostile", round_, "fed3r.stats", params, time.time() + 120)


def answers(sniffer: Sniffer, device: str) -> dict[str, object]:
    """The device's results and declines by task id."""
    out = {}
    for payload in sniffer.seen.get(T.outbox(device), []):
        env = decode(payload)
        if env.type in (M.RESULT, M.DECLINE):
            out[env.body["task"]] = env
    return out


def online(sniffer: Sniffer, device: str) -> bool:
    return any(decode(p).body.get("state") == "online" for p in sniffer.seen.get(T.presence(device), []))


def ask(sniffer: Sniffer, device: str, task: M.Envelope, timeout: float = 60.0):
    sniffer.publish(T.inbox(device), encode(task))
    wait_for(lambda: task.id in answers(sniffer, device), timeout=timeout, what=f"{device}'s answer to {task.body}")
    return answers(sniffer, device)[task.id]


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_a_fed3r_task_of_a_million_classes_is_declined_and_the_java_device_answers_on(broker, tmp_path: Path):
    Z, y = local_data()
    feats = tmp_path / "java0.feat"
    feats.write_bytes(struct.pack("<ii", *Z.shape) + Z.astype("<f4").tobytes() + y.astype("<i4").tobytes())
    sniffer = Sniffer(broker, [T.outbox("java0"), T.presence("java0"), T.outbox("py0"), T.presence("py0")])
    # a small heap, as a board or a gateway gives its device: a task within every params check still
    # outgrows it (one of 200,000 classes: the class sums and their wire copy, 210 MB)
    jvm = subprocess.Popen(["java", "-Xmx128m", "-cp", java_build.built(), "org.fedfleet.device.HeadlessDevices",
                            "--stop-on-stdin-eof", "--broker", broker.url, "--tick", "0.1", "--device", "java0",
                            str(feats), "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
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
