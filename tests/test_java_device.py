"""The Java device library (clients/java/) on the wire and in a fleet:

* its bytes equal the golden vectors (protocols/golden/) for the same content: a fed3r.stats
  result computed by the Java device from the golden features, its presence, its chunks and a
  message re-signed by its Ed25519 identity;
* Java devices and Python devices in one Fed3R job over mosquitto, every message signed both ways,
  give the centralized ridge over all their features (numpy and sklearn, relative error ≤ 1e-9),
  and so do they in one Fed3R-Sync group (SecAgg, and SecAgg+ with a device dropping out after
  its shares), the aggregator seeing only masked vectors; the SecAgg group also holds Python
  devices in a torch-free interpreter (``.venv-device``, only ``fedfleet[device]``:
  tests/torch_free_devices.py), next to the full Python devices in this process;
* the agent's MQTT life: back online after a broker restart, hostile inbox traffic dropped, results
  re-sent under one id until acknowledged, declines with reasons, last will, clean SIGTERM stop.

Features are fed through the library's FeatureFile/PrecomputedFeatures (float32 rows, what the
bundle's exported program outputs); here they are synthetic, as in the Python fleet tests.

The library is built with plain javac against Debian's jars (tests/java_build.py); nothing is
mocked: a real broker, real JVMs, real signatures.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from sklearn.linear_model import Ridge

import java_build

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "protocols" / "golden"
DEVICE_PYTHON = ROOT / ".venv-device" / "bin" / "python"
D, C, N = 6, 3, 30


@pytest.fixture(scope="module")
def java_cp() -> str:
    return java_build.built()


def write_features(path: Path, Z: np.ndarray, y: np.ndarray) -> Path:
    """The FeatureFile format: int32 n, int32 d, n·d float32, n int32 labels (little-endian)."""
    path.write_bytes(struct.pack("<ii", *Z.shape) + np.asarray(Z, "<f4").tobytes() + np.asarray(y, "<i4").tobytes())
    return path


def test_java_device_bytes_equal_the_golden_vectors(java_cp, tmp_path):
    # the features behind result_fed3r_stats (protocols/golden.py): the Java device computes A, b itself
    Z, y = np.array([[1.0, 2.0], [0.5, -1.0], [3.0, 0.25]]), np.array([0, 2, 2])
    feats = write_features(tmp_path / "golden.feat", Z, y)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(java_build.java_command("-cp", java_cp, "GoldenWire", str(GOLDEN), str(feats), str(out)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.loads((GOLDEN / "index.json").read_text())
    names = ["result_fed3r_stats", "presence_online", "result_signed_edge_cases", "result_fed3r_increment",
             "result_fed3r_factor", "result_fed3r_factor_zero_columns", "result_fed3r_factor_signed_zero",
             "result_fedavg_head", "result_fedavg_async"] + [n for n in index if n.startswith("chunk_")]
    assert len(names) == 13
    for name in names:
        assert (out / f"{name}.bin").read_bytes() == (GOLDEN / index[name]["file"]).read_bytes(), name
    assert f"PUBLIC_KEY {index['result_signed_edge_cases']['public_key']}" in proc.stdout
    assert f"ACK {'11' * 16} accepted" in proc.stdout
    assert f"TASK fed3r-demo/1/{'00' * 16} fed3r.stats 1767225720" in proc.stdout


def fleet_data(i: int) -> tuple[np.ndarray, np.ndarray]:
    """Device i's (synthetic) float32 features and labels; Java and Python devices read the same."""
    rng = np.random.default_rng(500 + i)
    return (rng.normal(size=(N, D)) * 2 + i).astype(np.float32), rng.integers(0, C, N)


class StopsAfterShares:
    """A Python device's secure handler that goes silent once it has sent its encrypted shares: it
    is in U2 but not U3, so its neighbours (Java devices among them) must reveal their shares of
    its mask key and the aggregator cancel its pair masks."""

    def __init__(self, inner):
        self.inner = inner

    def on_task(self, *args):
        return self.inner.on_task(*args)

    def on_message(self, env):
        if env.body["secagg"]["type"] == "secagg.forwarded_shares":
            return []
        return self.inner.on_message(env)


def start_torch_free_devices(broker, tmp_path: Path, keys: dict, aggregator_key: bytes) -> subprocess.Popen:
    """The LITE_IDS devices, in one process of the device venv's interpreter (no torch), reading
    the same FeatureFiles as the Java devices; they stop when their stdin closes."""
    devices = []
    for d in LITE_IDS:
        (tmp_path / f"{d}.pem").write_bytes(keys[d].to_pem())
        devices.append({"id": d, "features": str(write_features(tmp_path / f"{d}.feat", *fleet_data(ALL_IDS.index(d)))),
                        "identity": str(tmp_path / f"{d}.pem")})
    config = tmp_path / "torch_free_devices.json"
    config.write_text(json.dumps({"broker": broker.url, "aggregator_key": aggregator_key.hex(), "devices": devices}))
    proc = subprocess.Popen([str(DEVICE_PYTHON), str(ROOT / "tests" / "torch_free_devices.py"), str(config)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    for d in LITE_IDS:              # connected before the job starts (it waits for all expected devices anyway)
        line = proc.stdout.readline().strip()
        if line != f"ONLINE {d}":
            proc.kill()
            pytest.fail(f"torch-free devices: {line!r}\n{proc.communicate(timeout=10)[1][-3000:]}")
    return proc


def run_mixed_fleet(java_cp: str, broker, tmp_path: Path, secure: bool, graph: str = "complete",
                    dropper: str | None = None, java_chunk_size: int | None = None, torch_free: bool = False):
    """3 Java devices (one JVM) and 3 Python devices (with ``torch_free``, 2 more in a torch-free
    interpreter), every envelope signed both ways, in one Fed3R job (or Fed3R-Sync: one SecAgg group
    of them all, ``dropper`` silent after its shares); returns (job, config, the envelopes the
    aggregator received (reassembled), the senders of chunks, the devices)."""
    from ops_fleet import Features, RecordingService
    from aggregator.service.settings import ServiceSettings

    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
    from edge_client.agent import DeviceAgent
    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from edge_client.tasks.secure_fed3r import SecureFed3R
    from protocols.identity import DeviceIdentity, IdentityRegistry
    from protocols.mqtt_link import BrokerConfig
    from protocols.payloads.secagg import SECAGG_TYPE, SYNC_KIND

    devices = DEVICES + LITE_IDS if torch_free else DEVICES
    seeds = {d: os.urandom(32) for d in JAVA_IDS}
    keys = {**{d: DeviceIdentity.from_private_bytes(d, s) for d, s in seeds.items()},
            **{d: DeviceIdentity.generate(d) for d in devices if d not in seeds}}
    agg = DeviceIdentity.generate("aggregator")
    common = dict(job_id="mixed", num_classes=C, feature_dim=D, clients_per_round=len(devices),
                  expected_devices=len(devices), start_timeout_s=30, round_timeout_s=60)
    if secure:
        cfg = Fed3RSyncConfig(**common, max_samples=100, max_abs_feature=20.0, phase_timeout_s=4, max_attempts=1,
                              graph=graph)
        job = Fed3RSyncJob(cfg, identity=agg,
                           registry=IdentityRegistry({d: k.public_key_bytes for d, k in keys.items()}))
    else:
        # the devices' features are offset by i (energies per sample 4 + i² apart, 7x between the first
        # and the last: no one backbone gives honest devices that spread): the fleet screen is not
        # what this test is about, and with the median's lower middle value it screened py1 and py2
        cfg = Fed3RConfig(**common, max_attempts=2, screen_energy_ratio=0)
        job = Fed3RJob(cfg)
    lite = start_torch_free_devices(broker, tmp_path, keys, agg.public_key_bytes) if torch_free else None
    service = RecordingService(job, broker.url, tmp_path / "out", set(devices),
                               ServiceSettings(require_signatures=True), timeout_s=90, identity=agg)
    for d in devices:
        service.svc.registry.enroll(d, keys[d].public_key_bytes)

    cmd = java_build.java_command("-cp", java_cp, "org.fedfleet.device.HeadlessDevices", "--stop-on-stdin-eof",
                                  "--broker", broker.url, "--aggregator-key", agg.public_key_bytes.hex(),
                                  "--retry-after", "2", "--tick", "0.1")
    if java_chunk_size:
        cmd += ["--chunk-size", str(java_chunk_size)]
    if secure:          # their updates only through secure aggregation: what the secure kinds need is all there
        cmd += ["--secure-only"]
    for i, d in enumerate(JAVA_IDS):
        cmd += ["--device", d, str(write_features(tmp_path / f"{d}.feat", *fleet_data(i))), seeds[d].hex()]
    jvm = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    agents = []
    for i, d in enumerate(PY_IDS, start=len(JAVA_IDS)):
        stats = Fed3RStatsTask(*fleet_data(i), lambda b, s, w: Features(D))
        handlers, protocol = {"fed3r.stats": stats}, {}
        if secure:
            secure_handler = SecureFed3R(keys[d], agg.public_key_bytes, stats)
            if d == dropper:
                secure_handler = StopsAfterShares(secure_handler)
            handlers, protocol = {}, {SYNC_KIND: secure_handler, SECAGG_TYPE: secure_handler}
        agents.append(DeviceAgent(d, BrokerConfig.from_url(broker.url), handlers, protocol_handlers=protocol,
                                  signer=keys[d].sign, aggregator_key=agg.public_key_bytes, retry_after_s=2).start())
    result = service.join(90)
    for a in agents:
        a.stop()
    out, err = jvm.communicate(timeout=30)     # stdin closes: the Java devices say offline and exit
    assert jvm.returncode == 0, err[-3000:]
    if lite is not None:                       # so do the torch-free ones
        lite_out, lite_err = lite.communicate(timeout=30)
        assert lite.returncode == 0, lite_err[-3000:]
        for d in LITE_IDS:
            assert f"STATS {d} done=1 declined=0" in lite_out, (lite_out, lite_err[-3000:])
    assert result.get("state") == "done", (result, err[-3000:])
    assert sorted(result["contributed"]) == sorted(set(devices) - {dropper}), (result, err[-3000:])
    for d in JAVA_IDS:
        assert f"ONLINE {d}" in out and f"STATS {d} done=1 declined=0 " in out, (out, err[-3000:])
    from protocols.envelope import decode

    chunk_senders = {env.sender for env in map(decode, service.seen) if env.type == "chunk"}
    return job, cfg, service.received_envelopes(), chunk_senders, devices


JAVA_IDS, PY_IDS, LITE_IDS = ["java0", "java1", "java2"], ["py0", "py1", "py2"], ["lite0", "lite1"]
DEVICES = JAVA_IDS + PY_IDS
ALL_IDS = DEVICES + LITE_IDS          # a device's index here seeds its synthetic data


def assert_centralized_ridge(job, lam: float, devices=DEVICES) -> None:
    """The job's ridge equals the centralized one over the devices' features (bias as a column,
    regularised like the rest), by numpy and by sklearn."""
    Z = np.vstack([fleet_data(ALL_IDS.index(d))[0] for d in devices]).astype(np.float64)
    y = np.concatenate([fleet_data(ALL_IDS.index(d))[1] for d in devices])
    Za, Y = np.hstack([Z, np.ones((len(Z), 1))]), np.eye(C)[y]
    W_ref = np.linalg.solve(Za.T @ Za + lam * np.eye(D + 1), Za.T @ Y)
    W_sk = Ridge(alpha=lam, fit_intercept=False, solver="cholesky").fit(Za, Y).coef_.T
    W = job.strategy.solve().raw_weights_
    for ref in (W_ref, W_sk):
        assert np.linalg.norm(W - ref) / np.linalg.norm(ref) <= 1e-9


def test_mixed_java_and_python_fleet_gives_the_centralized_ridge(java_cp, broker, tmp_path):
    job, cfg, received, chunk_senders, _ = run_mixed_fleet(java_cp, broker, tmp_path, secure=False, java_chunk_size=200)
    assert {env.sender for env in received if env.type == "result"} == set(DEVICES)
    assert chunk_senders == set(JAVA_IDS)        # the Java devices' results travelled as 200-byte chunks
    assert_centralized_ridge(job, cfg.lam)


@pytest.mark.parametrize("graph, dropper, torch_free", [("complete", None, True), ("regular", "py1", False)])
def test_mixed_fleet_fed3r_sync_under_secure_aggregation_gives_the_centralized_ridge(java_cp, broker, tmp_path,
                                                                                    graph, dropper, torch_free):
    """Java and Python devices in one SecAgg (complete graph over 8: Java, full Python and
    torch-free Python devices) or SecAgg+ (4-regular graph over 6) group of Fed3R-Sync: the
    aggregator only ever gets masked vectors, from Java devices too, and the sum is the centralized
    ridge's statistics over the survivors; with a device that goes silent after sending its shares,
    the Java devices reveal their shares of its mask key."""
    if torch_free:
        if not DEVICE_PYTHON.exists():
            pytest.skip(f"{DEVICE_PYTHON} is missing (the torch-free device venv): `make setup` builds it")
        probe = subprocess.run([str(DEVICE_PYTHON), "-c", "import torch"], capture_output=True, text=True, check=False)
        assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr, "the device venv has torch"
    job, cfg, received, _, devices = run_mixed_fleet(java_cp, broker, tmp_path, secure=True, graph=graph,
                                                     dropper=dropper, torch_free=torch_free)
    types = {env.type for env in received}
    assert "secagg" in types and "result" not in types
    assert all("A_upper" not in env.tensors for env in received)

    def secagg(kind):
        return [env for env in received if env.type == "secagg" and env.body["secagg"]["type"] == kind]

    survivors = [d for d in devices if d != dropper]
    assert {env.sender for env in secagg("secagg.masked_input")} == set(survivors)
    assert {env.sender for env in secagg("secagg.encrypted_shares")} == set(devices)
    degree = 4 if graph == "regular" else len(devices) - 1     # SecAgg+: each device shares with 4 of 5 peers
    assert all(len(env.body["secagg"]["recipients"]) == degree for env in secagg("secagg.encrypted_shares"))
    if dropper:     # some Java device held a share of the dropper's mask key and revealed it, no b share of it
        revealed = [env.body["secagg"] for env in secagg("secagg.unmask_shares") if env.sender in JAVA_IDS]
        assert any(dropper in r["key_owners"] for r in revealed)
        assert not any(dropper in r["self_mask_owners"] for r in revealed)
    assert_centralized_ridge(job, cfg.lam, survivors)


def test_java_device_reconnects_refuses_forged_tasks_and_leaves_its_last_will(java_cp, tmp_path):
    """Presence, last will and reconnects of the Java MQTT agent, and what it does with hostile
    inbox traffic: after a broker restart it comes back and says online again; garbage and a
    task signed by anyone but the aggregator are dropped (no answer, the device lives on); a task
    the aggregator signed is answered with a signed result, re-sent with the same id while no ack
    comes; killed, it leaves `offline` behind."""
    import queue

    from fedfleet.emulation.broker import MosquittoBroker
    from protocols import messages as M
    from protocols.envelope import decode, encode
    from protocols.identity import DeviceIdentity, sender_verifier
    from protocols.mqtt_link import BrokerConfig, MqttLink
    from protocols.topics import Topics

    topics, dev = Topics(), "java0"
    seed, agg, impostor = os.urandom(32), DeviceIdentity.generate("aggregator"), DeviceIdentity.generate("aggregator")
    device_key = DeviceIdentity.from_private_bytes(dev, seed).public_key_bytes
    features = write_features(tmp_path / "f.feat", *fleet_data(0))
    broker = MosquittoBroker().start()
    jvm = subprocess.Popen(java_build.java_command("-cp", java_cp, "org.fedfleet.device.HeadlessDevices",
                                                   "--stop-on-stdin-eof", "--broker", broker.url, "--aggregator-key",
                                                   agg.public_key_bytes.hex(), "--retry-after", "0.3", "--tick",
                                                   "0.05", "--device", dev, str(features), seed.hex()),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    observer = None
    try:
        assert jvm.stdout.readline().strip() == f"ONLINE {dev}"
        broker.stop()
        broker = MosquittoBroker(port=broker.port).start()       # a new broker: no session, no retained state
        got: queue.Queue = queue.Queue()
        observer = MqttLink("observer", BrokerConfig.from_url(broker.url), on_message=lambda t, p: got.put((t, p)),
                            subscriptions=[(topics.presence(dev), 1), (topics.outbox(dev), 1)])
        observer.start()

        def next_message(timeout: float = 20.0):
            topic, payload = got.get(timeout=timeout)
            return topic, decode(payload, sender_verifier(dev, device_key))     # signed by the device

        topic, env = next_message()
        assert topic == topics.presence(dev) and M.parse_presence(env)[0] is True    # re-announced after reconnecting

        def task(signer) -> bytes:
            msg = M.task_message("aggregator", "j", 1, "fed3r.stats", {"num_classes": C, "backbone": "b", "image_size": 8,
                                                                       "weights_sha256": "", "fit_intercept": True,
                                                                       "random_features": None, "format": "sparse",
                                                                       "dtype": "float64"}, 1e10)
            return msg.id, encode(msg, signer=signer)

        forged_id, forged = task(impostor.sign)
        observer.publish(topics.inbox(dev), b"FFE1 garbage", wait=True)
        observer.publish(topics.inbox(dev), forged, wait=True)
        genuine_id, genuine = task(agg.sign)
        observer.publish(topics.inbox(dev), genuine, wait=True)
        results = []
        while len(results) < 3:                                   # the first upload and two retries (no ack comes)
            topic, env = next_message()
            assert topic == topics.outbox(dev) and env.type == "result"
            results.append(env)
        assert all(r.body["task"] == genuine_id != forged_id for r in results)   # only the genuine task answered
        assert len({r.id for r in results}) == 1 and results[0].body["n"] == N   # the same message id every time
        jvm.kill()                                                # no clean disconnect: the broker sends the will
        jvm.wait(10)
        while True:
            topic, env = next_message()
            if topic == topics.presence(dev):
                break
            assert env.id == results[0].id                        # a retry still in flight
        assert M.parse_presence(env)[0] is False
    finally:
        if observer is not None:
            observer.stop()
        if jvm.poll() is None:
            jvm.kill()
        jvm.communicate(timeout=10)
        broker.stop()


def test_java_device_declines_what_it_cannot_do_and_stops_cleanly_on_sigterm(java_cp, broker, tmp_path):
    """Tasks the Java device cannot do are declined with a reason (Fed3R-RF, local labels outside
    the job's classes, an unknown kind, a job_id param that is not the task's job); as a service it stops on SIGTERM, saying offline first."""
    import queue
    import signal

    from protocols import messages as M
    from protocols.envelope import decode, encode
    from protocols.identity import DeviceIdentity, sender_verifier
    from protocols.mqtt_link import BrokerConfig, MqttLink
    from protocols.topics import Topics

    topics, dev = Topics(), "java0"
    seed, agg = os.urandom(32), DeviceIdentity.generate("aggregator")
    device_key = DeviceIdentity.from_private_bytes(dev, seed).public_key_bytes
    jvm = subprocess.Popen(java_build.java_command("-cp", java_cp, "org.fedfleet.device.HeadlessDevices", "--broker",
                                                   broker.url, "--aggregator-key", agg.public_key_bytes.hex(),
                                                   "--device", dev,
                                                   str(write_features(tmp_path / "f.feat", *fleet_data(0))),
                                                   seed.hex()),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got: queue.Queue = queue.Queue()
    observer = MqttLink("observer", BrokerConfig.from_url(broker.url), on_message=lambda t, p: got.put((t, p)),
                        subscriptions=[(topics.outbox(dev), 1)])
    try:
        assert jvm.stdout.readline().strip() == f"ONLINE {dev}"
        observer.start()
        params = {"num_classes": C, "backbone": "b", "image_size": 8, "weights_sha256": "", "fit_intercept": True,
                  "random_features": None, "format": "sparse", "dtype": "float64"}
        cases = [("fed3r.stats", {**params, "random_features": {"seed": 1, "dim": 64, "sigma": 1.0}}, "random features"),
                 ("fed3r.stats", {**params, "num_classes": 2}, "outside the job's 2 classes"),
                 ("fedavg.tail", params, "unsupported task kind"),
                 # the key of a stateful task's state: never another job's (edge_client/agent.py alike)
                 ("fed3r.stats", {**params, "job_id": "other"}, "the task's job_id param 'other' is not its job 'j'"),
                 ("fed3r.stats", {**params, "job_id": None}, "the task's job_id param is not a string")]
        for round_, (kind, p, why) in enumerate(cases, start=1):
            task = M.task_message("aggregator", "j", round_, kind, p, 1e10)
            observer.publish(topics.inbox(dev), encode(task, signer=agg.sign), wait=True)
            _, payload = got.get(timeout=20)
            env = decode(payload, sender_verifier(dev, device_key))
            assert env.type == "decline" and env.body["task"] == task.id and why in env.body["reason"], env.body
        jvm.send_signal(signal.SIGTERM)
        out, err = jvm.communicate(timeout=20)
        assert f"STATS {dev} done=0 declined=5" in out, (out, err[-2000:])
        # what a dashboard subscribing now sees: the retained presence says offline, signed by the device
        seen: queue.Queue = queue.Queue()
        late = MqttLink("late", BrokerConfig.from_url(broker.url), on_message=lambda t, p: seen.put(p),
                        subscriptions=[(topics.presence(dev), 1)])
        late.start()
        try:
            assert M.parse_presence(decode(seen.get(timeout=10), sender_verifier(dev, device_key)))[0] is False
        finally:
            late.stop()
    finally:
        observer.stop()
        if jvm.poll() is None:
            jvm.kill()
            jvm.communicate(timeout=10)
