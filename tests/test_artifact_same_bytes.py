"""Files with the same bytes under different names (in one bundle, or in two bundles on one shelf):
a device asks for a file by its sha256 alone, so the aggregator answers under one of the names,
and the device still gets every bundle whole, each file under its own manifest's name (a review's
finding: the device refused the other name, "asked for X, got Y", and never got the bundle)."""

import hashlib

from aggregator.service.artifacts import ArtifactShelf
from edge_client.artifacts import fetch_bundle
from export.manifest import describe_artifact, write_bundle
from protocols.bundle_manifest import BatchSpec, InputNormalisation, Manifest, TensorSpec, read_manifest
from protocols.mqtt_link import BrokerConfig

from artifact_serving import serve

SIZE, FEATURES = 32, 8
PROGRAM = b"the same program bytes, whatever the file is called"


def _small_bundle(out, names_by_runtime: dict[str, str]):
    """A bundle listing ``PROGRAM`` once per runtime, under that runtime's name (no export runs)."""
    artifacts = [describe_artifact("inference", runtime, "1", name, PROGRAM, BatchSpec(None),
                                   (TensorSpec("image", "float32", (None, 3, SIZE, SIZE)),),
                                   (TensorSpec("features", "float32", (None, FEATURES)),), {})
                 for runtime, name in names_by_runtime.items()]
    manifest = Manifest(backbone="mobilenet_v2", weights_sha256="0" * 64, feature_dim=FEATURES, num_classes=3,
                        temperature=0.1, output="features",
                        input=InputNormalisation(SIZE, (0.5,) * 3, (0.25,) * 3),
                        artifacts=tuple(artifacts), created_with={})
    write_bundle(out, manifest, {name: PROGRAM for name in names_by_runtime.values()})
    return out


def test_files_with_the_same_bytes_under_other_names_are_fetched_under_their_manifests_names(broker, tmp_path):
    one = _small_bundle(tmp_path / "one", {"eager": "inference_eager.pt", "onnxruntime": "inference.onnx"})
    other = _small_bundle(tmp_path / "other", {"eager": "renamed_eager.pt"})
    shelf = ArtifactShelf()
    shas = [shelf.add_bundle(one), shelf.add_bundle(other)]
    svc, thread = serve(broker, tmp_path, shelf)
    try:
        cfg = BrokerConfig.from_url(broker.url)
        for sha, source in zip(shas, (one, other)):
            got = fetch_bundle("cam1", cfg, sha, tmp_path / "device" / sha[:12], timeout_s=30)
            assert hashlib.sha256(got.read_bytes()).hexdigest() == sha
            names = sorted(spec.file for spec in read_manifest(source).artifacts)
            assert sorted(p.name for p in got.parent.iterdir()) == sorted([*names, "manifest.json"])
            assert all((got.parent / name).read_bytes() == PROGRAM for name in names)
    finally:
        svc.stop()
        thread.join(10)
