"""Devices fetch an exported bundle from the aggregator over mosquitto, verify every digest, and run
it (the same outputs, the same features as eager); a file tampered with on the aggregator's side is
refused, and so are an unknown digest, a malformed request and a device not enrolled (issue 4,
distribution); a flood of asks for a file is answered a few times, not once per ask."""

import hashlib
import time

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from aggregator.service.artifacts import ArtifactShelf
from edge_client.artifacts import ArtifactFetchError, fetch_bundle
from edge_client.runtime import load_inference
from protocols.envelope import Envelope, encode
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.artifacts import ArtifactDigestMismatch, artifact_message, parse_artifact
from protocols.topics import Topics

from artifact_serving import answering, one_file_manifest, serve
from artifact_serving import bundle  # noqa: F401 (fixture)


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
        # an unknown digest: the aggregator says it holds no such file and the device stops at once
        # (it waited out its whole timeout before: a job naming such a bundle held its agent 120 s)
        started = time.monotonic()
        with pytest.raises(ArtifactFetchError, match="holds no artifact 0000000000000000"):
            fetch_bundle("cam1", cfg, "0" * 64, tmp_path / "nothing", timeout_s=60)
        assert time.monotonic() - started < 30
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
            if rej.get("artifact") and rej.get("not enrolled"):
                break
            time.sleep(0.1)
        raw.loop_stop()
        assert rej.get("artifact", 0) >= 2 and rej.get("not enrolled") == 1
        # the aggregator's copy of the model is altered after indexing: the aggregator sends no bytes
        # but those it indexed (it says it holds no such file), and a device refuses any other bytes
        onnx = bundle / "inference.onnx"
        pristine = onnx.read_bytes()
        onnx.write_bytes(pristine[:-1] + b"\x00")
        onnx_sha = hashlib.sha256(pristine).hexdigest()
        try:
            with pytest.raises(ArtifactFetchError, match=f"holds no artifact {onnx_sha[:16]}"):
                fetch_bundle("cam1", cfg, manifest_sha, tmp_path / "tampered", timeout_s=30)
            with pytest.raises(ArtifactDigestMismatch, match="refused"):
                parse_artifact(artifact_message("aggregator", onnx_sha, onnx.name, onnx.read_bytes()), onnx_sha)
        finally:
            onnx.write_bytes(pristine)
        assert not (tmp_path / "tampered" / "inference.onnx").exists()
    finally:
        svc.stop()
        t.join(10)


def test_a_folder_where_a_fetched_file_goes_is_replaced_as_a_stale_file_is(broker, tmp_path, bundle):
    """A review's finding: a folder under the name of a bundle's file in the device's bundle folder
    (its size matching the manifest's or not) failed each fetch of the bundle with IsADirectoryError,
    after the whole bundle had come in, until someone removed it (a rename cannot replace a folder).
    A stale file there is replaced by the fetch; so is such a folder, the manifest's name included."""
    program = b"a program of 24 bytes..."
    manifest = one_file_manifest(bundle, "head.pte", program)
    sha = hashlib.sha256(manifest).hexdigest()
    served = {sha: ("manifest.json", manifest), hashlib.sha256(program).hexdigest(): ("head.pte", program)}
    dest = tmp_path / "device-bundle"
    (dest / "head.pte" / "inside").mkdir(parents=True)
    (dest / "head.pte" / "inside" / "left.bin").write_bytes(b"x" * 24)
    (dest / "manifest.json").mkdir()
    with answering(broker, "cam1", served, asked := []):
        got = fetch_bundle("cam1", BrokerConfig.from_url(broker.url), sha, dest, timeout_s=30)
    assert got == dest / "manifest.json" and got.read_bytes() == manifest and asked == list(served)
    assert (dest / "head.pte").read_bytes() == program
    assert sorted(p.name for p in dest.iterdir()) == ["head.pte", "manifest.json"]


def test_a_flood_of_asks_for_a_file_is_answered_a_few_times(broker, tmp_path, bundle):
    """One enrolled device asking for the bundle's largest file as fast as it can: the service
    answers twice per window (ARTIFACT_RESEND_S), not once per ask. The flood starts once the
    service answers (asks published before it subscribed were lost: on a loaded machine, all of
    them), and the window is made longer than the test (two answers of 9 MB each may take longer
    than the real 30 s there, and a third answer would then be right)."""
    from aggregator.security.repeat_limit import RepeatLimiter

    shelf = ArtifactShelf()
    shelf.answers = RepeatLimiter(3600.0)
    shelf.add_bundle(bundle)
    onnx_sha = next(sha for sha in shelf._files if shelf._files[sha][0].name == "inference.onnx")
    svc, t = serve(broker, tmp_path, shelf)
    got = []
    raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="flood")
    raw.on_message = lambda c, u, m: got.append(len(m.payload))
    raw.connect("127.0.0.1", broker.port)
    raw.loop_start()
    try:
        raw.subscribe(Topics().inbox("cam1"), qos=1)
        ask = encode(Envelope("artifact.get", "cam1", {"sha256": onnx_sha}))
        deadline = time.time() + 60
        while not got and time.time() < deadline:      # asked until the service (subscribed now) answers
            raw.publish(Topics().outbox("cam1"), ask, qos=1)     # (asks before its subscription were lost)
            time.sleep(1.0)
        for _ in range(39):
            raw.publish(Topics().outbox("cam1"), ask, qos=1)
        size = shelf._files[onnx_sha][1]
        deadline, seen = time.time() + 120, (-1, -1)
        while time.time() < deadline and (sum(got) < 2 * size or seen != (shelf.answers.dropped, sum(got))):
            # until both answers are in and nothing moved for 3 s
            seen = (shelf.answers.dropped, sum(got))
            time.sleep(3.0)
        assert shelf.answers.dropped >= 38, (shelf.answers.dropped, sum(got), size)
        assert 2 * size <= sum(got) < 2 * size + 1_000_000, (sum(got), size)       # two answers, chunk headers
    finally:
        raw.loop_stop()
        svc.stop()
        t.join(30)


def test_a_fetched_bundle_extracts_the_same_features_as_eager(tmp_path, bundle):
    from edge_client.data import load_fashion_mnist
    from fedfleet.bundles import extractor_from_manifest, make_extractor

    X, _ = load_fashion_mnist("test")
    fx = extractor_from_manifest(bundle / "manifest.json", "onnxruntime", None)
    eager = make_extractor("mobilenet_v2", 32, None, "eager")
    assert fx.feature_dim == 1280 and fx.image_size == 32
    assert np.abs(fx.extract(X[:40]) - eager.extract(X[:40])).max() < 1e-4
