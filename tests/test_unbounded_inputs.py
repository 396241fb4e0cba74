"""What one device sends never grows the aggregator's state without bound: a storm of varied bad
messages (each with its own error text) leaves the metrics with labels from the fixed set of
rejection classes only (once every distinct rejection string became its own label), and a validly
signed result carrying an extra 10 MB tensor is refused and nothing of it is stored. Real agents
signing their messages, a real mosquitto, a real SQLite store and the real admin API."""

import sqlite3
import threading
import time

import numpy as np
from starlette.testclient import TestClient

from aggregator.service.active_job import REJECTION_CLASSES
from aggregator.api.app import create_app
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from edge_client.agent import DeviceAgent
from protocols import messages as M
from protocols.envelope import EnvelopeError, decode, encode
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

from ops_fleet import SyntheticStats, job_config, reference_sums
from test_admin_api import AUTH, TOKEN
from test_aggregator_over_mqtt import hostile_storm, raw_client
from test_containment import deep_envelope

DEVICES = ["dev00", "dev01", "dev02"]
EXTRA_BYTES = 10 * 1024 * 1024


class FatStats(SyntheticStats):
    """Real statistics; the first answer also carries an extra 10 MB tensor nobody asked for."""

    def __init__(self, device):
        super().__init__(device)
        self.calls = 0

    def __call__(self, params, tensors=None):
        body, tensors = super().__call__(params, tensors)
        self.calls += 1
        return (body, {**tensors, "padding": np.zeros(EXTRA_BYTES, np.uint8)}) if self.calls == 1 else (body, tensors)


def start(broker, tmp_path, keys, handlers, gate=None):
    store = Store(tmp_path / "state.db")
    for d in DEVICES:
        store.enroll_device(d, keys[d].public_key_bytes, None)
    job = Fed3RJob(Fed3RConfig(**job_config(DEVICES, round_timeout_s=30)))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(require_signatures=True, tick_s=0.05), store=store)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=90)), daemon=True)
    thread.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": handlers[d]}, signer=keys[d].sign,
                          retry_after_s=1, tick_s=0.1).start() for d in DEVICES]
    return svc, store, thread, result, agents


def test_a_storm_of_distinct_rejections_keeps_the_metrics_labels_to_the_fixed_classes(broker, tmp_path):
    keys = {d: DeviceIdentity.generate(d) for d in DEVICES}
    gate = threading.Event()
    svc, store, thread, result, agents = start(broker, tmp_path, keys,
                                               {d: SyntheticStats(d, gate) for d in DEVICES})
    deadline = time.time() + 30
    while svc.job.round == 0 and time.time() < deadline:
        time.sleep(0.05)
    topics, bad = Topics(), raw_client(broker)
    def signed(payload: bytes) -> bytes:       # a header the contract refuses (an integer past 2^64) goes as it is
        try:
            return encode(decode(payload), signer=keys["dev00"].sign)
        except EnvelopeError:
            return payload

    storm = [(topics.outbox("dev00"), signed(p)) for p in hostile_storm("ops", "dev00", 200, seed=3)]
    storm += [(topics.outbox("dev01"), p) for p in hostile_storm("ops", "dev01", 50, seed=4)]     # unsigned
    for i in range(100):    # each refused with its own text: another job, round, sender, device id
        ref = M.TaskRef(f"job-{i}", i, f"{i:032x}")
        storm.append((topics.outbox("dev00"), encode(M.result_message("dev00", ref, "fed3r.stats", {}, {}),
                                                     signer=keys["dev00"].sign)))
        storm.append((topics.outbox("dev02"), encode(M.presence_message(f"ghost-{i}", "online"))))
        storm.append((topics.presence(f"stranger-{i}"), deep_envelope(1000 + i)))
        storm.append((f"fedfleet/v1/dev/bad id {i}/out", b"x"))
    for topic, payload in storm:
        bad.publish(topic, payload, qos=1)
    bad.publish(topics.outbox("dev00"), b"", qos=1).wait_for_publish(10)
    deadline = time.time() + 30
    while sum(svc.live["job"]["stats"]["rejections"].values()) < len(storm) * 0.9 and time.time() < deadline:
        time.sleep(0.1)
    api = TestClient(create_app(store, TOKEN, svc))
    metrics = api.get("/metrics", headers=AUTH).text
    labels = {line.split('reason="')[1].split('"')[0] for line in metrics.splitlines()
              if line.startswith("fedfleet_rejections_total{")}
    gate.set()
    thread.join(60)
    for a in agents:
        a.stop()
    bad.loop_stop()
    rejections = result["rejections"]
    assert sum(rejections.values()) >= 0.9 * len(storm), rejections
    assert labels <= set(REJECTION_CLASSES) and len(labels) >= 6, labels
    assert set(rejections) <= set(REJECTION_CLASSES)
    assert result["state"] == "done" and sorted(result["contributed"]) == DEVICES


def test_a_signed_result_with_an_extra_10_mb_tensor_is_refused_and_nothing_of_it_stored(broker, tmp_path):
    keys = {d: DeviceIdentity.generate(d) for d in DEVICES}
    fat = FatStats("dev01")
    handlers = {d: fat if d == "dev01" else SyntheticStats(d) for d in DEVICES}
    svc, store, thread, result, agents = start(broker, tmp_path, keys, handlers)
    thread.join(90)
    for a in agents:
        a.stop()
    assert result["state"] == "done" and sorted(result["contributed"]) == DEVICES, result
    assert fat.calls == 2                           # refused once, asked again, then contributed
    # refused; on a loaded machine the device may resend that same message before the refusal
    # reaches it (no ack within its retry window), and the resend is refused too
    assert result["rejections"].get("invalid payload", 0) >= 1, result["rejections"]
    assert set(result["rejections"]) == {"invalid payload"}, result["rejections"]
    db = sqlite3.connect(tmp_path / "state.db")
    rows = db.execute("SELECT device, payload_bytes FROM contributions ORDER BY device").fetchall()
    assert [d for d, _ in rows] == DEVICES and max(n for _, n in rows) < 10_000, rows
    stored = [f for f in [*tmp_path.glob("state.db*"), *store.blobs.directory.iterdir()] if f.is_file()]
    assert sum(f.stat().st_size for f in stored) < EXTRA_BYTES                 # WAL and payload files included
    events = db.execute("SELECT device, event, reason FROM round_events").fetchall()
    assert [(d, e) for d, e, _ in events] == [("dev01", "rejected")] and "padding" in events[0][2], events
    A_ref, B_ref = reference_sums(DEVICES)
    stats = np.load(tmp_path / "out" / "statistics.npz")
    assert np.array_equal(stats["A"], A_ref) and np.array_equal(stats["B"], B_ref)
