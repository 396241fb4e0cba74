"""A job that names its bundle (``bundle_sha256``): ``fedfleet device`` started without one fetches it
on demand, within its disk budgets, and computes its statistics with it; a malformed digest is
refused before anything is fetched; a fetch in a task waits no longer than the task, and a bundle
the aggregator does not serve is not asked for again by each task."""

import threading
import time

import numpy as np
import pytest

from aggregator.service.artifacts import ArtifactShelf
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

from artifact_serving import bundle  # noqa: F401 (fixture)


@pytest.mark.slow
def test_a_job_names_its_bundle_and_the_device_fetches_it_on_demand(broker, tmp_path, bundle):
    """`fedfleet device` started without a bundle: the job's tasks name one (bundle_sha256), the
    device fetches it from the aggregator, verifies it and computes its statistics with it. Its
    disk budgets hold: an old bundle and an old feature file, beyond them, are gone; the bundle
    in use and the features just computed stay (edge_client/disk_budget.py). The bundle budget has
    room for the bundle (one larger than the whole budget is not fetched), not for it and the old one."""
    import struct
    import subprocess
    import sys

    from sklearn.linear_model import Ridge

    from edge_client.data import load_fashion_mnist
    from edge_client.models import weights_sha256
    from fedfleet.bundles import extractor_from_manifest
    from fedfleet.emulation.partition import train_holdout_split

    images, labels = load_fashion_mnist("test")
    x, y = images[:20], labels[:20].astype(np.uint8)
    for name, arr, code in (("images", x, 0x08), ("labels", y, 0x08)):
        (tmp_path / f"{name}.idx").write_bytes(struct.pack(">HBB", 0, code, arr.ndim)
                                                + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes())
    shelf = ArtifactShelf()
    manifest_sha = shelf.add_bundle(bundle)
    bundle_mb = sum(p.stat().st_size for p in bundle.iterdir()) / 2**20 + 1       # the bundle's room, and 1 MB
    stale_bundle = tmp_path / "fetched" / ("ab" * 8) / "model.onnx"       # a bundle of an earlier job
    stale_features = tmp_path / "cache" / "features-old.npy"
    for stale in (stale_bundle, stale_features):
        stale.parent.mkdir(parents=True)
        stale.write_bytes(bytes(2 << 20))
    job = Fed3RJob(Fed3RConfig(num_classes=10, image_size=32, feature_dim=1280, bundle_sha256=manifest_sha,
                               weights_sha256=weights_sha256("mobilenet_v2"), expected_devices=1,
                               start_timeout_s=120, round_timeout_s=120))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "agg",
                            ServiceSettings(evaluate_every_contribution=False), enrolled={"cam9"}, artifacts=shelf)
    result = {}
    t = threading.Thread(target=lambda: result.update(svc.run(timeout_s=150)), daemon=True)
    t.start()
    device = subprocess.Popen([sys.executable, "-m", "fedfleet.cli", "device", "--id", "cam9", "--broker", broker.url,
                               "--idx", str(tmp_path / "images.idx"), str(tmp_path / "labels.idx"),
                               "--runtime", "onnxruntime", "--threads", "1", "--bundle-dir", str(tmp_path / "fetched"),
                               "--bundle-disk-mb", str(bundle_mb), "--cache-dir", str(tmp_path / "cache"),
                               "--feature-cache-mb", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t.join(160)
    finally:
        device.terminate()
        log, _ = device.communicate(timeout=30)
    assert result.get("state") == "done" and list(result["contributed"]) == ["cam9"], log[-3000:]
    assert sorted(p.name for p in (tmp_path / "fetched").iterdir()) == [manifest_sha[:16]]   # in use: kept
    assert (tmp_path / "fetched" / manifest_sha[:16] / "manifest.json").exists()
    kept = list((tmp_path / "cache").glob("features-*.npy"))
    assert not stale_features.exists() and len(kept) == 1 and kept[0].stat().st_size < 1 << 20
    # the statistics are those of the bundle's features on the device's training split
    train, _ = train_holdout_split(np.arange(20), 0.2, 0)
    Z = extractor_from_manifest(bundle / "manifest.json", "onnxruntime", None).extract(x[train]).astype(np.float64)
    Za = np.hstack([Z, np.ones((len(Z), 1))])
    W_ref = Ridge(alpha=0.01, fit_intercept=False, solver="cholesky").fit(Za, np.eye(10)[y[train]]).coef_.T
    W = job.strategy.solve().raw_weights_
    assert np.linalg.norm(W - W_ref) / np.linalg.norm(W_ref) <= 1e-6


def test_a_malformed_bundle_digest_is_refused_before_anything_is_fetched(tmp_path):
    """A job's bundle_sha256 names a directory on the device: only a 64-hex digest is accepted,
    by the job config, the admin API's validation, and the device (no connection is attempted)."""
    from aggregator.jobs.fedavg import FedAvgConfig
    from aggregator.jobs.registry import validate_job_config
    from edge_client.agent import TaskDeclined
    from fedfleet.device_bundles import FetchedBundles

    for bad in ("../../etc/passwd", "A" * 64, "0" * 63, "info"):
        with pytest.raises(ValueError, match="sha256"):
            Fed3RConfig(bundle_sha256=bad)
        with pytest.raises(ValueError, match="bundle_sha256"):
            FedAvgConfig(bundle_sha256=bad)
        with pytest.raises(ValueError, match="bundle_sha256"):
            validate_job_config("fed3r", {"bundle_sha256": bad})
        factory = FetchedBundles("cam1", BrokerConfig.from_url("mqtt://127.0.0.1:9"), Topics(), tmp_path / "b",
                                 "onnxruntime", None, default=None, local=None)
        with pytest.raises(TaskDeclined, match="bad bundle_sha256"):
            factory("mobilenet_v2", 32, "", bundle_sha256=bad)
        assert not (tmp_path / "b").exists()
    validate_job_config("fed3r", {"bundle_sha256": ""})                 # "": devices use their own


def test_a_bundle_fetch_in_a_task_waits_no_longer_than_the_task_and_is_not_retried_by_each_task(broker, tmp_path):
    """A review's finding: a task naming a bundle its device had not fetched waited up to 120 s a
    file whatever the task's deadline, and a bundle the aggregator did not serve was asked for again
    by every task of the job, each waiting again. The fetch now ends with the task's time, and the
    device remembers for a few minutes that the bundle was unavailable: the job's next tasks decline
    at once with the same reason; past that time it asks again."""
    import edge_client.artifacts as artifacts_module
    from edge_client.agent import TaskDeclined
    from edge_client.work_deadline import PastDeadline, working_until
    from fedfleet.device_bundles import FetchedBundles

    sha = "ab" * 32                         # nobody answers for it: no aggregator on this broker
    fetched = FetchedBundles("cam1", BrokerConfig.from_url(broker.url), Topics(), tmp_path / "b",
                             "onnxruntime", None, default=None, local=None)
    started = time.monotonic()
    with working_until(time.time() + 2.0), pytest.raises(TaskDeclined, match=f"bundle {sha[:16]} unavailable") as first:
        fetched("mobilenet_v2", 32, "", bundle_sha256=sha)
    assert time.monotonic() - started < 15                  # the task's 2 s (and a connect), not 120
    started = time.monotonic()
    with working_until(time.time() + 60.0), pytest.raises(TaskDeclined) as again:
        fetched("mobilenet_v2", 32, "", bundle_sha256=sha)
    assert time.monotonic() - started < 0.5 and str(again.value) == str(first.value)
    # remembered for a bounded time only: past it the device asks again (and a task already past its
    # moment stops before asking)
    fetched.unavailable.expire(time.monotonic() + artifacts_module.UNAVAILABLE_FOR_S + 1)
    with working_until(time.time() - 1.0), pytest.raises(PastDeadline):
        fetched("mobilenet_v2", 32, "", bundle_sha256=sha)
