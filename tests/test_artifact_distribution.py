"""Devices fetch an exported bundle from the aggregator over mosquitto, verify every digest, and
run it; a file tampered with on the aggregator's side is refused (issue 4, distribution)."""

import threading
import time

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from aggregator.artifacts import ArtifactShelf
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service import AggregatorService
from edge_client.artifacts import ArtifactFetchError, fetch_bundle
from edge_client.runtime import load_inference
from protocols.envelope import Envelope, encode
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from export import export_bundle

    out = tmp_path_factory.mktemp("bundle") / "mnv2-32"
    export_bundle("mobilenet_v2", out, num_classes=10, image_size=32, inference_runtimes=("onnxruntime",),
                  training=False)
    return out


def serve(broker, tmp_path, shelf):
    # an idle Fed3R job that waits for devices: the service answers artifact requests meanwhile
    job = Fed3RJob(Fed3RConfig(num_classes=10, feature_dim=4, expected_devices=99, start_timeout_s=1e6))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "agg", enrolled={"cam1"},
                            artifacts=shelf)
    t = threading.Thread(target=lambda: svc.run(timeout_s=120), daemon=True)
    t.start()
    return svc, t


def test_fetched_bundle_runs_like_the_original_and_tampering_is_refused(broker, tmp_path, bundle):
    shelf = ArtifactShelf()
    manifest_sha = shelf.add_bundle(bundle)
    svc, t = serve(broker, tmp_path, shelf)
    try:
        cfg = BrokerConfig.from_url(broker.url)
        got = fetch_bundle("cam1", cfg, manifest_sha, tmp_path / "device-bundle", timeout_s=30)
        x = np.random.default_rng(0).normal(size=(3, 3, 32, 32)).astype(np.float32)
        fetched = load_inference(got, prefer=("onnxruntime",), expected_manifest_sha256=manifest_sha)
        original = load_inference(bundle / "manifest.json", prefer=("onnxruntime",))
        np.testing.assert_array_equal(fetched.run(x), original.run(x))
        # an unknown digest is refused by the aggregator; the device gives up with a clear error
        with pytest.raises(ArtifactFetchError, match="within"):
            fetch_bundle("cam1", cfg, "0" * 64, tmp_path / "nothing", timeout_s=2)
        # a malformed request, and a request from a device that is not enrolled, are rejected
        raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw")
        raw.connect("127.0.0.1", broker.port)
        raw.loop_start()
        raw.publish(Topics().outbox("cam1"), encode(Envelope("artifact.get", "cam1", {"sha256": "../etc"})),
                    qos=1).wait_for_publish(5)
        raw.publish(Topics().outbox("intruder"),
                    encode(Envelope("artifact.get", "intruder", {"sha256": manifest_sha})), qos=1).wait_for_publish(5)
        deadline = time.time() + 10
        while time.time() < deadline:
            rej = svc.active.stats.rejections
            if rej.get("artifact") and rej.get("unknown device (not enrolled)"):
                break
            time.sleep(0.1)
        raw.loop_stop()
        assert rej.get("artifact", 0) >= 2 and rej.get("unknown device (not enrolled)") == 1
        # the aggregator's copy of the model is altered after indexing: the device refuses it
        onnx = bundle / "inference.onnx"
        pristine = onnx.read_bytes()
        onnx.write_bytes(pristine[:-1] + b"\x00")
        try:
            with pytest.raises(ArtifactFetchError, match="refused"):
                fetch_bundle("cam1", cfg, manifest_sha, tmp_path / "tampered", timeout_s=30)
        finally:
            onnx.write_bytes(pristine)
        assert not (tmp_path / "tampered" / "inference.onnx").exists()
    finally:
        svc.stop()
        t.join(10)


def test_a_fetched_bundle_extracts_the_same_features_as_eager(tmp_path, bundle):
    from edge_client.data import load_fashion_mnist
    from fedfleet.bundles import extractor_from_manifest, make_extractor

    X, _ = load_fashion_mnist("test")
    fx = extractor_from_manifest(bundle / "manifest.json", "onnxruntime", None)
    eager = make_extractor("mobilenet_v2", 32, None, "eager")
    assert fx.feature_dim == 1280 and fx.image_size == 32
    assert np.abs(fx.extract(X[:40]) - eager.extract(X[:40])).max() < 1e-4
