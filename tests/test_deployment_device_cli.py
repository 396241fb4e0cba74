"""A real ``fedfleet device --deployments DIR`` follows a rollout (issue 29) over mosquitto: it fetches
the job's bundle from the aggregator, judges the deployed head on its held-out split through the
bundle's ONNX program, swaps, reports counts equal to the ones computed here, and after a restart
runs the same head again without fetching or reporting anything."""

import hashlib
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from aggregator.deployments.controller import DeploymentController
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.artifacts import ArtifactShelf
from aggregator.service.loop import AggregatorService
from aggregator.storage.store import Store
from edge_client.data import load_fashion_mnist
from edge_client.data.split import train_holdout_split
from edge_client.features import FeatureExtractor
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.deployment import head_npz
from ops_fleet import wait_for

ROOT = Path(__file__).resolve().parents[1]
N, C = 60, 10

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundle(onnx_bundle_32px):
    return onnx_bundle_32px


def write_idx(path, array):
    path.write_bytes(struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
                     + array.tobytes())


def device(broker, tmp_path, sha, idx, log_file):
    """A real ``fedfleet device`` process; its output goes to ``log_file`` (read while it runs)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "fedfleet.cli", "device", "--id", "cam1", "--broker", broker.url,
                             "--idx", *map(str, idx), "--runtime", "onnxruntime", "--threads", "1",
                             "--bundle-sha", sha, "--bundle-dir", str(tmp_path / "bundles"),
                             "--deployments", str(tmp_path / "deployed")],
                            stdout=open(log_file, "w"), stderr=subprocess.STDOUT, text=True, env=env)


def stop(proc, log_file):
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return log_file.read_text()


def test_a_device_follows_a_rollout_on_its_bundles_features(broker, bundle, tmp_path):
    images, labels = load_fashion_mnist("train")
    pick = np.random.default_rng(0).permutation(len(labels))[:N]
    x, y = images[pick], labels[pick].astype(np.uint8)
    idx = (tmp_path / "images.idx", tmp_path / "labels.idx")
    write_idx(idx[0], x)
    write_idx(idx[1], y)
    train, holdout = train_holdout_split(np.arange(N), 0.2, 0)           # the device command's default split
    extractor = FeatureExtractor.from_bundle(bundle / "manifest.json", "onnxruntime", None)
    Z_train, Z_hold = extractor.extract(x[train]), extractor.extract(x[holdout])
    # a ridge head on the training split's features (numpy), the model the operator deploys
    A = np.hstack([Z_train, np.ones((len(train), 1))]).astype(np.float64)
    coef = np.linalg.solve(A.T @ A + 0.1 * np.eye(A.shape[1]), A.T @ np.eye(C)[y[train]]).T
    W, b = coef[:, :-1], coef[:, -1]
    W32, b32 = W.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)
    expected = int(((Z_hold @ W32.T + b32).argmax(1) == y[holdout]).sum())

    shelf = ArtifactShelf()
    sha = shelf.add_bundle(bundle)
    store = Store(tmp_path / "state.db")
    store.enroll_device("cam1", None, None)
    store.create_job("fed3r-j", "fed3r", {"bundle_sha256": sha})
    model = store.finish_job("fed3r-j", "done", {}, {}, {"coef": W, "intercept": b}, {}, 1)
    # the service answers the device's bundle fetch; the controller rolls the head out
    svc = AggregatorService(Fed3RJob(Fed3RConfig(num_classes=C, feature_dim=4, expected_devices=99, start_timeout_s=1e6)),
                            BrokerConfig.from_url(broker.url), tmp_path / "agg", enrolled={"cam1"}, artifacts=shelf)
    thread = threading.Thread(target=lambda: svc.run(timeout_s=300), daemon=True)
    thread.start()
    ctl = DeploymentController(store, BrokerConfig.from_url(broker.url), tick_s=0.1).start()
    logs = [tmp_path / "device-1.log", tmp_path / "device-2.log"]
    proc = device(broker, tmp_path, sha, idx, logs[0])
    log = ""
    try:
        ctl.call(lambda: ctl.deploy(model, cohort="devices:cam1", stages="100%", bake_s=0, min_reports=1,
                                    deployment_id="ridge-1"))
        wait_for(lambda: ctl.show("ridge-1")["state"] == "complete", 180, "the rollout to complete")
        report = ctl.show("ridge-1")["devices"]["cam1"]["report"]
        assert report == {"deployment": "ridge-1", "seq": ctl.last["cam1"][1],
                          "sha256": hashlib.sha256(head_npz(W, b)).hexdigest(),
                          "n": len(holdout), "correct_candidate": expected, "correct_current": 0}
        sent_at = ctl.show("ridge-1")["devices"]["cam1"]["sent_at"]
        log += stop(proc, logs[0])
        proc = device(broker, tmp_path, sha, idx, logs[1])   # restarted: the same head, nothing fetched or sent
        try:
            wait_for(lambda: "running head" in logs[1].read_text(), 120, "the restarted device to load its head")
        except AssertionError as exc:      # seen once on CI under the suite's start-up load: say what the device did
            raise AssertionError(f"{exc}; the device's output so far:\n{logs[1].read_text()[-3000:]}") from None
        time.sleep(5)                                        # time to meet the retained assignment again
        log += stop(proc, logs[1])
        assert "running head" in log and "of deployment ridge-1" in log, log[-3000:]
        assert ctl.show("ridge-1")["devices"]["cam1"] == {"sent": "run", "sent_at": sent_at, "report": report,
                                                          "enrolled_at": store.device("cam1")["enrolled_at"]}
    finally:
        if proc.poll() is None:
            log += stop(proc, logs[1] if logs[1].exists() else logs[0])
        ctl.stop()
        svc.stop()
        thread.join(30)
    assert "Traceback" not in log, log[-3000:]
