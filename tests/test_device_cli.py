"""``fedfleet device`` as an operator runs it: three real device processes reading IDX files of
Fashion-MNIST images, signing with their Ed25519 keys, against mosquitto and the aggregator.

A Fed3R-Sync job (secure aggregation) must give the centralized ridge solution over the devices'
*training* splits (recomputed here from the same images), and a personalization job must report
counts over exactly their held-out splits."""

import json
import os
import stat
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from sklearn.linear_model import Ridge

from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from aggregator.jobs.personalize import PersonalizeConfig, PersonalizeJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.data import load_fashion_mnist
from edge_client.features import FeatureExtractor
from edge_client.models import weights_sha256
from fedfleet.emulation.partition import train_holdout_split
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.mqtt_link import BrokerConfig

SIZE, PER_DEVICE = 32, 50
DEVICES = {"cam-a": (0, 1, 2), "cam-b": (3, 4, 5, 6), "cam-c": (7, 8, 9, 0)}


def write_idx(path, array):
    code = {np.dtype(np.uint8): 0x08}[array.dtype]
    path.write_bytes(struct.pack(">HBB", 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
                     + array.tobytes())


def device_data(images, labels, classes, seed):
    idx = np.random.default_rng(seed).permutation(np.flatnonzero(np.isin(labels, classes)))[:PER_DEVICE]
    return images[idx], labels[idx].astype(np.uint8)


def run_job(job, broker, out_dir, ids, identity=None):
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), out_dir,
                            ServiceSettings(evaluate_every_contribution=False), enrolled=set(ids), identity=identity)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=240)), daemon=True)
    thread.start()
    thread.join(250)
    return result


@pytest.mark.slow
def test_device_cli_serves_secure_fed3r_and_personalization(broker, tmp_path):
    images, labels = load_fashion_mnist("train")
    agg = DeviceIdentity.generate("aggregator")
    keys, data, procs = {}, {}, []
    try:
        for i, (dev, classes) in enumerate(DEVICES.items()):
            x, y = data[dev] = device_data(images, labels, classes, i)
            write_idx(tmp_path / f"{dev}-images.idx", x)
            write_idx(tmp_path / f"{dev}-labels.idx", y)
            keys[dev] = DeviceIdentity.generate(dev)
            (tmp_path / f"{dev}.pem").write_bytes(keys[dev].to_pem())
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fedfleet.cli", "device", "--id", dev, "--broker", broker.url,
                 "--idx", str(tmp_path / f"{dev}-images.idx"), str(tmp_path / f"{dev}-labels.idx"),
                 "--cache-dir", str(tmp_path / "cache"), "--threads", "1", "--holdout-fraction", "0.2",
                 "--identity", str(tmp_path / f"{dev}.pem"), "--aggregator-key", agg.public_key_bytes.hex(),
                 "--secure-only"],         # it declines plain updates, and serves both jobs all the same
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        registry = IdentityRegistry({d: k.public_key_bytes for d, k in keys.items()})
        common = dict(num_classes=10, backbone="mobilenet_v2", image_size=SIZE,
                      weights_sha256=weights_sha256("mobilenet_v2"), feature_dim=1280, expected_devices=3,
                      start_timeout_s=120, round_timeout_s=180, clients_per_round=3)
        fed3r = Fed3RSyncJob(Fed3RSyncConfig(job_id="sync", max_samples=100, phase_timeout_s=60, max_attempts=1,
                                             **common), identity=agg, registry=registry)
        result = run_job(fed3r, broker, tmp_path / "fed3r", list(DEVICES))
        assert result.get("state") == "done" and sorted(result["contributed"]) == sorted(DEVICES), result

        extractor = FeatureExtractor.eager("mobilenet_v2", image_size=SIZE, cache_dir=tmp_path / "cache", threads=1)
        split = {d: train_holdout_split(np.arange(PER_DEVICE), 0.2, 0) for d in DEVICES}   # the CLI's default seed
        Z = np.vstack([extractor.extract(data[d][0][split[d][0]]) for d in DEVICES]).astype(np.float64)
        y = np.concatenate([data[d][1][split[d][0]] for d in DEVICES]).astype(int)
        Za = np.hstack([Z, np.ones((len(Z), 1))])
        W_ref = Ridge(alpha=0.01, fit_intercept=False, solver="cholesky").fit(Za, np.eye(10)[y]).coef_.T
        W = fed3r.strategy.solve().raw_weights_
        assert np.linalg.norm(W - W_ref) / np.linalg.norm(W_ref) <= 1e-6

        oll = PersonalizeJob(PersonalizeConfig(job_id="oll", head_file=str(tmp_path / "fed3r" / "model.npz"),
                                               fp_epochs=2, **common))
        # the devices verify every aggregator message with its key: this job's messages are signed too
        result = run_job(oll, broker, tmp_path / "oll", list(DEVICES), identity=agg)
        assert result.get("state") == "done" and oll.contributions == 3, result
        summary = oll.summary()
        assert summary["test_samples"] == sum(len(split[d][1]) for d in DEVICES)
        assert all(oll.contributed[d]["n_train"] == len(split[d][0]) for d in DEVICES)
        assert summary["wma"]["oll"] >= summary["wma"]["global"]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                out, _ = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            if "Traceback" in (out or ""):
                print(out)


def test_a_device_joins_from_the_credentials_enrolment_returned(broker, tmp_path):
    """`fedfleet device --credentials FILE` with exactly what enrolment returned: it signs with the
    generated key, verifies the aggregator's messages with its key, and its statistics are accepted
    by an aggregator that requires signatures."""
    import json

    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.storage.store import Store

    images, labels = load_fashion_mnist("train")
    x, y = device_data(images, labels, (0, 1, 2), 0)
    write_idx(tmp_path / "images.idx", x)
    write_idx(tmp_path / "labels.idx", y)
    aggregator = DeviceIdentity.generate("aggregator")
    config = Fed3RConfig(num_classes=10, backbone="mobilenet_v2", image_size=SIZE,
                         weights_sha256=weights_sha256("mobilenet_v2"), expected_devices=1, clients_per_round=1,
                         round_timeout_s=120)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(require_signatures=True), store=Store(tmp_path / "state.db"),
                            identity=aggregator)
    creds = svc.enroll("cam-z").to_dict()
    assert creds["private_key_pem"] and creds["aggregator_public_key"] == aggregator.public_key_bytes.hex()
    (tmp_path / "creds.json").write_text(json.dumps(creds))
    proc = subprocess.Popen([sys.executable, "-m", "fedfleet.cli", "device", "--credentials",
                             str(tmp_path / "creds.json"), "--broker", broker.url, "--idx", str(tmp_path / "images.idx"),
                             str(tmp_path / "labels.idx"), "--cache-dir", str(tmp_path / "cache"), "--threads", "1",
                             "--holdout-fraction", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        result = svc.run(timeout_s=180)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert result["state"] == "done" and list(result["contributed"]) == ["cam-z"], out[-2000:]
    assert result["contributed"]["cam-z"] == PER_DEVICE and result["rejections"] == {}


def test_a_device_keeps_its_state_by_default_and_answers_a_weighed_cap_without_it(broker, tmp_path):
    """`fedfleet device` with no state option keeps a private folder of its own, $FEDFLEET_STATE_HOME/<id>
    (the suite's conftest points it at a temporary folder) and writes down the window it answered in
    its sample-window ledger. A DP-clipped Fed3R job capping each device at 20 samples caps by weight
    (``cap_by_weight``): all 50 samples, each weighed 20/50, the window [0, 50) of all of them, which
    a device without a state folder (--no-state) answers too (a cap to the first 20 it declined)."""
    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.storage.store import Store
    from edge_client.sample_windows import WINDOWS_FILE

    images, labels = load_fashion_mnist("train")
    flags = {"cam-kept": [], "cam-unkept": ["--no-state"]}
    procs = []
    for i, (dev, extra) in enumerate(flags.items()):
        x, y = device_data(images, labels, (0, 1, 2), i)
        write_idx(tmp_path / f"{dev}-images.idx", x)
        write_idx(tmp_path / f"{dev}-labels.idx", y)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "fedfleet.cli", "device", "--id", dev, "--broker", broker.url,
             "--idx", str(tmp_path / f"{dev}-images.idx"), str(tmp_path / f"{dev}-labels.idx"),
             "--cache-dir", str(tmp_path / "cache"), "--threads", "1", "--holdout-fraction", "0", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    config = Fed3RConfig(num_classes=10, backbone="mobilenet_v2", image_size=SIZE,
                         weights_sha256=weights_sha256("mobilenet_v2"), feature_clip_norm=1e3, max_samples=20,
                         expected_devices=2, clients_per_round=2, max_attempts=1, round_timeout_s=120)
    store = Store(tmp_path / "state.db")
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(evaluate_every_contribution=False), store=store, enrolled=set(flags))
    try:
        result = svc.run(timeout_s=180)
    finally:
        for p in procs:
            p.terminate()
        out = {dev: p.communicate(timeout=30)[0] for dev, p in zip(flags, procs)}
    assert result["contributed"] == {"cam-kept": 20, "cam-unkept": 20}, (result, out)   # 50 samples weighed to 20

    folder = Path(os.environ["FEDFLEET_STATE_HOME"]) / "cam-kept"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert json.loads((folder / WINDOWS_FILE).read_text()) == {"boundaries": [0, PER_DEVICE]}
    assert f"device cam-kept keeps its state in {folder}\n" in out["cam-kept"]
    assert "device cam-unkept keeps no state (--no-state)" in out["cam-unkept"]
    assert not (folder.parent / "cam-unkept").exists()
