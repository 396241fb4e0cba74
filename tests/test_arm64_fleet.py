"""ARM64 devices for real, under emulation, in a mixed fleet (issue 28; ``make test-arm64``).

``make test-arm64`` builds an aarch64 Debian userland with ``fedfleet[device]`` installed from
PyPI's aarch64 wheels (tests/arm64/build_rootfs.sh) and runs this file with
``FEDFLEET_ARM64_ROOT`` naming it; ``make test`` skips it. One fleet over a real mosquitto:

* x86-64 torch-free devices (``fedfleet device`` from ``.venv-device``),
* ARM64 torch-free devices (``fedfleet device`` from the rootfs's python3 under
  qemu-aarch64-static: tests/arm64/python.sh),
* Java devices (clients/java, one JVM) on features of the same bundle,

runs one Fed3R job and one FedAvg(ψ) job on an exported MobileNetV2 bundle that the Python
devices fetch from the aggregator. The Fed3R model is checked against the centralized ridge on the
features each device actually computed (read back from its feature cache), the FedAvg(ψ) head
against a FedAvg of heads trained here with eager torch on those features. Printed: how far the
ARM64 devices' ONNX Runtime features are from x86 ones on the same images, the model's error
against the ridge on each, and each device's CPU time (the ARM64 ones emulated).
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import java_build
from aggregator.jobs.robustness_fields import PLAIN_MEAN

ROOT = Path(__file__).resolve().parents[1]
ARM64_ROOTFS = os.environ.get("FEDFLEET_ARM64_ROOT", "")
ARM64_PYTHON = ROOT / "tests" / "arm64" / "python.sh"
X86_PYTHON = ROOT / ".venv-device" / "bin" / "python"
SIZE, C, D, PER_DEVICE, LAM = 32, 10, 1280, 40, 0.01
X86, ARM64, JAVA = ("x86-a", "x86-b"), ("arm64-a", "arm64-b"), ("java-a", "java-b")
FLEET = X86 + ARM64 + JAVA

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ARM64_ROOTFS, reason="make test-arm64 builds the ARM64 rootfs and sets "
                                                          "FEDFLEET_ARM64_ROOT")]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A 32 px MobileNetV2 bundle with only its ONNX feature program: what torch-free devices run."""
    from export import export_bundle

    return export_bundle("mobilenet_v2", tmp_path_factory.mktemp("arm64") / "bundle", num_classes=C, image_size=SIZE,
                         batch_size=8, inference_runtimes=("onnxruntime",), training=False).parent


def fleet_data(folder: Path) -> dict:
    """Each device's images and labels (3-4 Fashion-MNIST classes) with the device CLI's split."""
    from edge_client.data import load_fashion_mnist
    from edge_client.data.split import train_holdout_split

    images, labels = load_fashion_mnist("train")
    data = {}
    for i, dev in enumerate(FLEET):
        classes = [(2 * i + k) % C for k in range(4)]
        idx = np.random.default_rng(i).permutation(np.flatnonzero(np.isin(labels, classes)))[:PER_DEVICE]
        x, y = images[idx], labels[idx].astype(np.uint8)
        for name, array in (("images", x), ("labels", y)):
            (folder / f"{dev}-{name}.idx").write_bytes(struct.pack(">HBB", 0, 0x08, array.ndim)
                                                       + struct.pack(f">{array.ndim}I", *array.shape)
                                                       + array.tobytes())
        train, _ = train_holdout_split(np.arange(PER_DEVICE), 0.2, 0)     # the device CLI's default split
        data[dev] = {"idx": (folder / f"{dev}-images.idx", folder / f"{dev}-labels.idx"),
                     "x": x[train], "y": y[train].astype(np.int64), "cache": folder / dev / "cache"}
    return data


def x86_features(manifest: Path, images: np.ndarray, cache: Path) -> tuple[np.ndarray, str]:
    """The bundle's ONNX features of ``images`` computed here (x86-64), and the name of the feature
    cache file a device writes for exactly these images and this program."""
    from edge_client.features import FeatureExtractor

    features = FeatureExtractor.from_bundle(manifest, "onnxruntime", cache).extract(images)
    (name,) = [p.name for p in cache.glob("features-*.npy")]
    return features, name


class DeviceProcesses:
    """Device processes logging to files; ``stop`` ends them with SIGTERM and returns each one's CPU
    seconds (user + system, from wait4: the ARM64 ones include qemu's translation)."""

    def __init__(self, logs: Path):
        self.logs, self.procs = logs, {}

    def start(self, name: str, argv: list[str], env: dict | None = None) -> None:
        log = (self.logs / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env)
        log.close()

    def await_ready(self, names, line: str, timeout_s: float) -> None:
        """Until each of ``names`` printed ``line.format(name)``; fails at once with the log of one that died."""
        deadline = time.monotonic() + timeout_s
        for name in names:
            while line.format(name) not in self.log(name):
                assert self.procs[name].poll() is None, f"{name} exited:\n{self.log(name)[-4000:]}"
                assert time.monotonic() < deadline, f"{name} not ready in {timeout_s} s:\n{self.log(name)[-4000:]}"
                time.sleep(0.5)

    def stop(self) -> dict[str, float]:
        cpu = {}
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for name, proc in self.procs.items():
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    cpu[name] = usage.ru_utime + usage.ru_stime
                    break
                if time.monotonic() > deadline:
                    proc.kill()
                time.sleep(0.2)
        return cpu

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()


def python_device_argv(dev: str, data: dict, broker, tmp_path: Path) -> list[str]:
    return ["-m", "fedfleet.cli", "device", "--id", dev, "--broker", broker.url, "--idx", *map(str, data["idx"]),
            "--runtime", "onnxruntime", "--threads", "1", "--bundle-dir", str(tmp_path / dev / "bundles"),
            "--cache-dir", str(data["cache"]),
            # named: an ARM64 device's environment is clean (tests/arm64/python.sh), no FEDFLEET_STATE_HOME
            "--state-dir", str(tmp_path / dev / "state")]


def write_feature_file(path: Path, Z: np.ndarray, y: np.ndarray) -> Path:
    """The Java library's FeatureFile: int32 n, int32 d, n·d float32, n int32 labels (little-endian)."""
    path.write_bytes(struct.pack("<ii", *Z.shape) + np.asarray(Z, "<f4").tobytes() + np.asarray(y, "<i4").tobytes())
    return path


def run_job(job, broker, out_dir: Path, shelf) -> dict:
    from aggregator.service.loop import AggregatorService
    from aggregator.service.settings import ServiceSettings
    from protocols.mqtt_link import BrokerConfig

    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), out_dir,
                            ServiceSettings(evaluate_every_contribution=False), enrolled=set(FLEET), artifacts=shelf)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=500)), daemon=True)
    thread.start()
    thread.join(510)
    return result


def ridge(Z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The centralized ridge with the bias as a column, regularised like the rest (Fed3R's raw weights)."""
    Za = np.hstack([Z.astype(np.float64), np.ones((len(Z), 1))])
    return np.linalg.solve(Za.T @ Za + LAM * np.eye(Za.shape[1]), Za.T @ np.eye(C)[y])


def fedavg_reference(job, features: dict, labels: dict) -> dict:
    """FedAvg of heads trained here with eager torch (an implementation independent of the devices'
    numpy and Java steps) from the global head on each device's own features, weighted by n_k."""
    from aggregator.jobs.fedavg import random_head
    from edge_client.tasks.head_training import LocalTraining, train_head

    cfg = job.config
    head = random_head(C, D, cfg.seed)
    for round_ in range(1, cfg.rounds + 1):
        trained, weights = [], []
        for dev in FLEET:
            recipe = LocalTraining(epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.device_lr,
                                   weight_decay=cfg.weight_decay, temperature=cfg.temperature,
                                   seed=zlib.crc32(f"{cfg.seed}:{round_}:{dev}".encode()))
            out = train_head(head["weight"], head["bias"], features[dev], labels[dev], recipe)
            trained.append((out.weight.astype(np.float64), out.bias.astype(np.float64)))
            weights.append(len(labels[dev]))
        share = np.asarray(weights, np.float64) / sum(weights)
        head = {"weight": sum(s * w for s, (w, _) in zip(share, trained)),
                "bias": sum(s * b for s, (_, b) in zip(share, trained))}
    return head


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_arm64_x86_and_java_devices_run_fed3r_and_fedavg_psi(bundle, broker, tmp_path):
    import onnxruntime

    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
    from aggregator.jobs.robustness_fields import PLAIN_MEAN
    from aggregator.service.artifacts import ArtifactShelf

    if java_build.missing():
        pytest.fail(java_build.missing())
    assert X86_PYTHON.exists(), f"{X86_PYTHON} is missing: `make setup` builds it"
    probe = subprocess.run([str(ARM64_PYTHON), ARM64_ROOTFS, "", "-c", "import platform, onnxruntime; "
                            "print(platform.machine(), onnxruntime.__version__)"], capture_output=True, text=True)
    assert probe.returncode == 0 and probe.stdout.startswith("aarch64 "), probe.stderr[-3000:]
    manifest = bundle / "manifest.json"
    data = fleet_data(tmp_path)
    # the x86 reference features of every device's training images, and the cache file name of each
    x86, cache_name = {}, {}
    for dev in FLEET:
        x86[dev], cache_name[dev] = x86_features(manifest, data[dev]["x"], tmp_path / "host-cache" / dev)
    for dev in JAVA:      # the Java devices are handed features (x86 ONNX), as an app would be
        write_feature_file(tmp_path / f"{dev}.feat", x86[dev], data[dev]["y"])

    shelf = ArtifactShelf()
    sha = shelf.add_bundle(bundle)
    common = dict(num_classes=C, image_size=SIZE, feature_dim=D, bundle_sha256=sha, expected_devices=len(FLEET),
                  clients_per_round=len(FLEET), start_timeout_s=400, round_timeout_s=400)
    fed3r = Fed3RJob(Fed3RConfig(job_id="fed3r-arm64", lam=LAM, **common))
    # bounded-influence defaults off: the check below is FedAvg's plain weighted mean of the devices' heads
    fedavg = FedAvgJob(FedAvgConfig(job_id="fedavg-arm64", rounds=2, batch_size=16, client_lr=0.05, seed=3,
                                    **PLAIN_MEAN, **common))

    devices = DeviceProcesses(tmp_path)
    for dev in X86:
        devices.start(dev, [str(X86_PYTHON), *python_device_argv(dev, data[dev], broker, tmp_path)],
                      env={**os.environ, "PYTHONPATH": str(ROOT)})
    for dev in ARM64:       # the rootfs's own fedfleet (build_rootfs.sh installed this tree's wheel)
        devices.start(dev, [str(ARM64_PYTHON), ARM64_ROOTFS, str(tmp_path),
                            *python_device_argv(dev, data[dev], broker, tmp_path)])
    java = java_build.java_command("-cp", java_build.built(), "org.fedfleet.device.HeadlessDevices", "--broker",
                                   broker.url, "--retry-after", "2", "--tick", "0.1")
    for dev in JAVA:
        java += ["--device", dev, str(tmp_path / f"{dev}.feat"), "-"]
    devices.start("java", java)
    started = time.monotonic()
    try:
        # a device that dies at start-up fails the test now, not after the job's start timeout
        devices.await_ready(X86 + ARM64, "device {}: ", timeout_s=300)
        fed3r_result = run_job(fed3r, broker, tmp_path / "fed3r", shelf)
        fed3r_wall = time.monotonic() - started
        fedavg_result = run_job(fedavg, broker, tmp_path / "fedavg", shelf)
    finally:
        cpu = devices.stop()
    logs = "\n".join(f"--- {name}\n{devices.log(name)[-2500:]}" for name in devices.procs)
    assert fed3r_result.get("state") == "done" and sorted(fed3r_result["contributed"]) == sorted(FLEET), \
        (fed3r_result, logs)
    assert fedavg_result.get("state") == "done" and len(fedavg_result["rounds"]) == 2, (fedavg_result, logs)
    assert all(sorted(r["accepted"]) == sorted(FLEET) for r in fedavg_result["rounds"]), (fedavg_result["rounds"], logs)
    for dev in ARM64:
        assert "Traceback" not in devices.log(dev), logs

    # what each Python device computed: its feature cache holds exactly these images' features
    computed = {dev: x86[dev] for dev in JAVA}
    for dev in X86 + ARM64:
        cached = data[dev]["cache"] / cache_name[dev]
        assert cached.exists(), (dev, sorted(p.name for p in data[dev]["cache"].glob("*")), logs)
        computed[dev] = np.load(cached)
        assert computed[dev].shape == x86[dev].shape
    Z = np.vstack([computed[dev] for dev in FLEET])
    y = np.concatenate([data[dev]["y"] for dev in FLEET])
    W = fed3r.strategy.solve().raw_weights_
    error_vs_computed = relative(W, ridge(Z, y))
    error_vs_x86 = relative(W, ridge(np.vstack([x86[dev] for dev in FLEET]), y))

    labels = {dev: data[dev]["y"] for dev in FLEET}
    head = fedavg_reference(fedavg, computed, labels)
    fedavg_error = max(relative(fedavg.params[k], head[k]) for k in ("weight", "bias"))

    print(f"\nARM64 mixed fleet: ARM64 devices {probe.stdout.split()[0]} (qemu-aarch64-static, onnxruntime "
          f"{probe.stdout.split()[1]}), x86 reference onnxruntime {onnxruntime.__version__}")
    for dev in X86 + ARM64:
        diff = np.abs(computed[dev].astype(np.float64) - x86[dev])
        print(f"  {dev:8s} features vs x86 ONNX Runtime here on the same {len(diff)} images: max |Δ| "
              f"{diff.max():.3e}, relative {relative(computed[dev], x86[dev]):.3e} "
              f"(feature scale max |z| {np.abs(x86[dev]).max():.2f})")
    print(f"  Fed3R model vs centralized ridge on the features the devices computed: relative error "
          f"{error_vs_computed:.3e}")
    print(f"  Fed3R model vs centralized ridge on x86 features everywhere:            relative error "
          f"{error_vs_x86:.3e}")
    print(f"  FedAvg(psi) head vs eager-torch FedAvg on the devices' features:       relative error "
          f"{fedavg_error:.3e}")
    print(f"  wall time from the devices' start to the Fed3R model: {fed3r_wall:.1f} s")
    for name, seconds in cpu.items():
        print(f"  CPU time of {name:8s} (both jobs, start-up included): {seconds:7.1f} s")
    x86_cpu = np.mean([cpu[d] for d in X86])
    arm_cpu = np.mean([cpu[d] for d in ARM64])
    print(f"  ARM64 under emulation / x86 device CPU time: {arm_cpu / x86_cpu:.1f}x")

    assert error_vs_computed <= 1e-6
    assert fedavg_error <= 1e-4
    # other kernels round differently, but an ARM64 device computes the same features to float32 noise
    assert all(relative(computed[dev], x86[dev]) <= 1e-4 for dev in ARM64)
