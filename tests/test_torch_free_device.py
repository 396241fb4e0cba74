"""A torch-free device (issue 19): ``fedfleet device`` run from ``.venv-device``, a venv holding only
``fedfleet[device]`` (ONNX Runtime, numpy, paho-mqtt, cryptography, Pillow; ``make setup`` builds it),
against mosquitto and an aggregator from the full venv. The job names an exported bundle; the devices
fetch it from the aggregator and extract features with its ONNX program, and train the head in numpy.

* Fed3R-Sync (secure aggregation) gives the centralized ridge on the same ONNX features.
* FedAvg(ψ) gives the FedAvg of heads trained here with eager torch (an independent implementation
  of the step the devices take in numpy), then OLL personalization reports over exactly the devices'
  held-out splits, with the global head's count equal to one computed here.
* A mixed fleet: a torch-free device declines an FT(φ) task, saying why (recorded by the aggregator),
  while a full device completes the job.
"""

import os
import struct
import subprocess
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from sklearn.linear_model import Ridge

from aggregator.service.artifacts import ArtifactShelf
from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob, random_head
from aggregator.jobs.fedavg_tail import TailFedAvgConfig, TailFedAvgJob
from aggregator.jobs.personalize import PersonalizeConfig, PersonalizeJob
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from edge_client.agent import DeviceAgent
from edge_client.data import load_fashion_mnist
from edge_client.data.split import train_holdout_split
from edge_client.features import FeatureExtractor
from edge_client.tasks.head_training import LocalTraining, train_head
from edge_client.tasks.tail_training import TailTrainingTask
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fedavg import KIND_TAIL

ROOT = Path(__file__).resolve().parents[1]
DEVICE_PYTHON = ROOT / ".venv-device" / "bin" / "python"
SIZE, C, PER_DEVICE = 32, 10, 40
DEVICES = {"lite-a": (0, 1, 2, 3), "lite-b": (3, 4, 5, 6), "lite-c": (7, 8, 9, 0)}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def device_python():
    if not DEVICE_PYTHON.exists():
        pytest.fail(f"{DEVICE_PYTHON} is missing: `make setup` builds it (python -m venv .venv-device && "
                    ".venv-device/bin/pip install -e '.[device]')")
    probe = subprocess.run([str(DEVICE_PYTHON), "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr, "the device venv has torch"
    return DEVICE_PYTHON


@pytest.fixture(scope="module")
def bundle(mobilenet_bundle_32px):
    """MobileNetV2 at 32 px: the ONNX feature program (what a torch-free device runs) and, for the
    mixed fleet, the FT(φ) programs (trunk, last stage + head training, the aggregator's tail_eval)."""
    return mobilenet_bundle_32px


@pytest.fixture(scope="module")
def fleet_data(tmp_path_factory):
    """Each device's IDX files, images and labels, and its training / held-out split (the CLI's)."""
    folder = tmp_path_factory.mktemp("idx")
    images, labels = load_fashion_mnist("train")
    data = {}
    for seed, (dev, classes) in enumerate(DEVICES.items()):
        idx = np.random.default_rng(seed).permutation(np.flatnonzero(np.isin(labels, classes)))[:PER_DEVICE]
        x, y = images[idx], labels[idx].astype(np.uint8)
        for name, array in (("images", x), ("labels", y)):
            (folder / f"{dev}-{name}.idx").write_bytes(struct.pack(">HBB", 0, 0x08, array.ndim)
                                                       + struct.pack(f">{array.ndim}I", *array.shape)
                                                       + array.tobytes())
        train, holdout = train_holdout_split(np.arange(PER_DEVICE), 0.2, 0)   # the CLI's default split
        data[dev] = {"idx": (folder / f"{dev}-images.idx", folder / f"{dev}-labels.idx"), "x": x,
                     "y": y.astype(np.int64), "train": train, "holdout": holdout}
    return data


class TorchFreeDevices:
    """``fedfleet device`` processes from the device venv; their output is kept for failure messages."""

    def __init__(self, python, broker, data, tmp_path, extra=lambda dev: [], runtime="onnxruntime"):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        chosen = ["--runtime", runtime] if runtime else []      # none: a torch-free device's default, auto
        self.procs = [subprocess.Popen(
            [str(python), "-m", "fedfleet.cli", "device", "--id", dev, "--broker", broker.url,
             "--idx", *map(str, data[dev]["idx"]), *chosen, "--threads", "1",
             "--bundle-dir", str(tmp_path / dev / "bundles"), "--cache-dir", str(tmp_path / dev / "cache"),
             *extra(dev)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for dev in data]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.log = ""
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                self.log += p.communicate(timeout=30)[0]
            except subprocess.TimeoutExpired:
                p.kill()
                self.log += p.communicate()[0]
        if exc[0] is not None or "Traceback" in self.log:
            print(self.log[-6000:])


def run_job(job, broker, out_dir, ids, shelf, store=None):
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), out_dir,
                            ServiceSettings(evaluate_every_contribution=False), enrolled=set(ids), artifacts=shelf,
                            store=store)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=240)), daemon=True)
    thread.start()
    thread.join(250)
    return result


def onnx_features(bundle, images):
    return FeatureExtractor.from_bundle(bundle / "manifest.json", "onnxruntime", None).extract(images)


def test_torch_free_devices_run_fed3r_sync_to_the_centralized_ridge(device_python, bundle, fleet_data, broker,
                                                                    tmp_path):
    shelf = ArtifactShelf()
    sha = shelf.add_bundle(bundle)
    agg = DeviceIdentity.generate("aggregator")
    keys = {dev: DeviceIdentity.generate(dev) for dev in DEVICES}
    for dev, key in keys.items():
        (tmp_path / f"{dev}.pem").write_bytes(key.to_pem())
    job = Fed3RSyncJob(Fed3RSyncConfig(job_id="sync", num_classes=C, image_size=SIZE, feature_dim=1280,
                                       bundle_sha256=sha, expected_devices=3, clients_per_round=3, max_samples=100,
                                       start_timeout_s=120, round_timeout_s=180, phase_timeout_s=60, max_attempts=1),
                       identity=agg, registry=IdentityRegistry({d: k.public_key_bytes for d, k in keys.items()}))
    with TorchFreeDevices(device_python, broker, fleet_data, tmp_path, lambda dev: [
            "--identity", str(tmp_path / f"{dev}.pem"), "--aggregator-key", agg.public_key_bytes.hex()],
            runtime=None) as devices:
        result = run_job(job, broker, tmp_path / "agg", list(DEVICES), shelf)
    assert result.get("state") == "done" and sorted(result["contributed"]) == sorted(DEVICES), result
    # the default runtime of a torch-free device is auto: of the bundle's programs only the ONNX one can run
    assert devices.log.count(f"bundle {sha[:16]}: --runtime auto chose onnxruntime") == 3, devices.log[-3000:]

    # centralized ridge on the bundle's ONNX features of every device's training split
    Z = np.vstack([onnx_features(bundle, d["x"][d["train"]]) for d in fleet_data.values()]).astype(np.float64)
    y = np.concatenate([d["y"][d["train"]] for d in fleet_data.values()])
    Za = np.hstack([Z, np.ones((len(Z), 1))])
    W_ref = Ridge(alpha=0.01, fit_intercept=False, solver="cholesky").fit(Za, np.eye(C)[y]).coef_.T
    W = job.strategy.solve().raw_weights_
    assert np.linalg.norm(W - W_ref) / np.linalg.norm(W_ref) <= 1e-6


def test_torch_free_devices_run_fedavg_psi_then_oll(device_python, bundle, fleet_data, broker, tmp_path):
    shelf = ArtifactShelf()
    sha = shelf.add_bundle(bundle)
    common = dict(num_classes=C, image_size=SIZE, feature_dim=1280, bundle_sha256=sha, expected_devices=3,
                  clients_per_round=3, start_timeout_s=120, round_timeout_s=120)
    # bounded-influence defaults off: this test holds the device path to FedAvg's plain weighted mean
    fedavg = FedAvgJob(FedAvgConfig(job_id="ft", rounds=2, batch_size=16, client_lr=0.05, seed=3,
                                    **PLAIN_MEAN, **common))
    with TorchFreeDevices(device_python, broker, fleet_data, tmp_path):
        ft_result = run_job(fedavg, broker, tmp_path / "ft", list(DEVICES), shelf)
        oll = PersonalizeJob(PersonalizeConfig(job_id="oll", head_file=str(tmp_path / "ft" / "model.npz"),
                                               fp_epochs=1, fp_lrs=[1e-3], fp_folds=2, **common))
        oll_result = run_job(oll, broker, tmp_path / "oll", list(DEVICES), shelf)
    assert ft_result.get("state") == "done" and len(ft_result["rounds"]) == 2, ft_result
    assert all(sorted(r["accepted"]) == sorted(DEVICES) for r in ft_result["rounds"]), ft_result["rounds"]

    # FedAvg reference: each round, every device's head trained here with eager torch from the global
    # head on its ONNX features, with the job's recipe and per-device seed, then averaged with weights n_k
    cfg = fedavg.config
    head = random_head(C, 1280, cfg.seed)
    features = {dev: onnx_features(bundle, d["x"][d["train"]]) for dev, d in fleet_data.items()}
    for round_ in (1, 2):
        trained, weights = [], []
        for dev, d in fleet_data.items():
            recipe = LocalTraining(epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.device_lr,
                                   weight_decay=cfg.weight_decay, temperature=cfg.temperature,
                                   seed=zlib.crc32(f"{cfg.seed}:{round_}:{dev}".encode()))
            out = train_head(head["weight"], head["bias"], features[dev], d["y"][d["train"]], recipe)
            assert out.runtime == "torch"
            trained.append((out.weight.astype(np.float64), out.bias.astype(np.float64)))
            weights.append(len(d["train"]))
        share = np.asarray(weights, np.float64) / sum(weights)
        head = {"weight": sum(s * w for s, (w, _) in zip(share, trained)),
                "bias": sum(s * b for s, (_, b) in zip(share, trained))}
    for name in ("weight", "bias"):
        np.testing.assert_allclose(fedavg.params[name], head[name], rtol=1e-4, atol=1e-6)
    assert not np.allclose(fedavg.params["weight"], random_head(C, 1280, cfg.seed)["weight"], atol=1e-4)

    assert oll_result.get("state") == "done" and oll.contributions == 3, oll_result
    summary = oll.summary()
    assert summary["test_samples"] == sum(len(d["holdout"]) for d in fleet_data.values())
    W, b = fedavg.params["weight"], fedavg.params["bias"]
    for dev, d in fleet_data.items():
        report = oll.contributed[dev]
        assert report["n_train"] == len(d["train"])
        global_correct = int(((onnx_features(bundle, d["x"][d["holdout"]]) @ W.T + b).argmax(1)
                              == d["y"][d["holdout"]]).sum())
        assert report["correct"]["global"] == global_correct, report


def test_a_mixed_fleet_serves_ft_phi_while_the_torch_free_device_declines_saying_why(
        device_python, bundle, fleet_data, broker, tmp_path):
    """FT(φ) trains the backbone's last stage: the torch-free device declines (the store keeps its
    reason), the full device (in process, with torch and ExecuTorch) trains, and the job completes."""
    full, lite = "full-0", "lite-a"
    data = fleet_data[lite]
    shelf = ArtifactShelf()
    store = Store(tmp_path / "state.db")
    job = TailFedAvgJob(TailFedAvgConfig(job_id="ft-phi", num_classes=C, feature_dim=1280, image_size=SIZE, rounds=1,
                                         clients_per_round=2, local_epochs=1, batch_size=10, client_lr=0.01,
                                         round_timeout_s=120, start_timeout_s=120, expected_devices=2, train="tail",
                                         tail_stages=1, tail_program_file=str(bundle / "tail_eval.pt2"), init="zeros",
                                         bundle_sha256=shelf.add_bundle(bundle)))
    agent = DeviceAgent(full, BrokerConfig.from_url(broker.url),
                        {KIND_TAIL: TailTrainingTask(data["x"], data["y"], bundle / "manifest.json")}).start()
    try:
        with TorchFreeDevices(device_python, broker, {lite: data}, tmp_path):
            result = run_job(job, broker, tmp_path / "agg", [full, lite], shelf, store=store)
    finally:
        agent.stop()
    assert result.get("state") == "done" and list(result["contributed"]) == [full], result
    (round_,) = result["rounds"]
    assert round_["accepted"] == [full] and round_["declined"] == [lite], round_
    events = store.round_events("ft-phi", 1)
    assert [(e["device"], e["event"]) for e in events] == [(lite, "declined")], events
    assert "torch-free" in events[0]["reason"] and "fedfleet[device-executorch]" in events[0]["reason"]


def test_the_device_command_runs_without_torch_and_says_what_needs_it(device_python, tmp_path):
    fedfleet = device_python.parent / "fedfleet"            # the console script pip installed there
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    help_text = subprocess.run([str(fedfleet), "device", "--help"], capture_output=True, text=True, env=env)
    assert help_text.returncode == 0 and "--runtime" in help_text.stdout, help_text.stderr
    eager = subprocess.run([str(fedfleet), "device", "--id", "x", "--runtime", "eager", "--idx", "a", "b"],
                           capture_output=True, text=True, env=env)
    assert eager.returncode != 0 and "torch-free" in eager.stderr and "Traceback" not in eager.stderr
