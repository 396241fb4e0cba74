"""Full bundles for both backbones: parity of .pte / .onnx with eager torch on real images,
the manifest's contents, refusal of tampered files, and errors for missing runtimes.

MobileNetV2 is the suite's shared bundle (conftest ``mobilenet_bundle_32px``: 32 px, batch bound
8, the FT(φ) tail programs too); EfficientNet-Lite0 is exported here at 64 px with the default
batch bound 32 and runtimes (the slow part: ~20 s per .pte), so both an 8-row and a 32-row
bound run 45 rows (full chunks and a partial one). The images compared here (Fashion-MNIST
test[1000:1045]) are not the ones the exporter used.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys

import numpy as np
import pytest
import torch

from edge_client.data.idx import load_fashion_mnist
from edge_client.models import build_backbone, weights_sha256
from edge_client.models.preprocess import to_model_input
from edge_client.runtime import (
    ArtifactMissingError,
    ArtifactTamperedError,
    RuntimeUnavailableError,
    TrainingSession,
    file_sha256,
    load_inference,
    read_manifest,
    verify_bundle,
)
from export import export_bundle
from export.parity import load_parity_images

pytestmark = pytest.mark.slow  # two backbones exported to every runtime: xdist starts this file first

IMAGE_SIZE = 64          # the EfficientNet-Lite0 bundle exported here; MobileNetV2's is the shared 32 px one
NUM_CLASSES = 10
TOLERANCE = 1e-4  # the acceptance criterion; not to be loosened here
BACKBONE_NAMES = ("mobilenet_v2", "efficientnet_lite0")

@pytest.fixture(scope="module")
def efficientnet_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("efficientnet_lite0") / "bundle"
    return export_bundle("efficientnet_lite0", out, num_classes=NUM_CLASSES, image_size=IMAGE_SIZE,
                         parity_images=load_parity_images(count=48))


@pytest.fixture(scope="module")
def mobilenet_bundle(mobilenet_bundle_32px):
    """The shared bundle's manifest: read it, never write into it (tampering tests copy it)."""
    return mobilenet_bundle_32px / "manifest.json"


@pytest.fixture(scope="module", params=BACKBONE_NAMES)
def bundle(request):
    name = request.param
    return name, request.getfixturevalue("mobilenet_bundle" if name == "mobilenet_v2" else "efficientnet_bundle")


@pytest.fixture(scope="module")
def test_images():
    images, labels = load_fashion_mnist("test")
    return images[1000:1045], labels[1000:1045]


def eager_features(name, images, image_size):
    backbone = build_backbone(name)
    inputs = to_model_input(images, image_size, backbone.mean, backbone.std)
    with torch.no_grad():
        return inputs, backbone(torch.from_numpy(inputs)).numpy()


@pytest.mark.parametrize("runtime", ["executorch", "onnxruntime", "eager"])
def test_artifact_matches_eager_on_real_images(bundle, runtime, test_images):
    name, manifest_path = bundle
    size = read_manifest(manifest_path).input.image_size
    inputs, expected = eager_features(name, test_images[0], size)  # 45 rows: full chunks + a partial one
    model = load_inference(manifest_path, prefer=(runtime,))
    assert model.runtime == runtime
    outputs = model.run(inputs)
    assert outputs.shape == (45, 1280) and outputs.dtype == np.float32
    error = float(np.max(np.abs(outputs - expected)))
    assert error <= TOLERANCE, f"{name} {runtime}: max abs error {error:.3g} > {TOLERANCE}"
    # Single rows go through the same program (batch 1 is within the dynamic bound).
    assert np.max(np.abs(model.run(inputs[:1]) - expected[:1])) <= TOLERANCE


def test_executorch_row_slicing_keeps_results(mobilenet_bundle, test_images):
    from edge_client.runtime.executorch_runtime import ExecuTorchInference
    from edge_client.runtime.verification import read_verified

    manifest = read_manifest(mobilenet_bundle)
    size = manifest.input.image_size
    inputs, expected = eager_features("mobilenet_v2", test_images[0][:11], size)
    spec = manifest.find("inference", "executorch")
    program = read_verified(manifest, spec)
    for rows_per_call in (1, 4, spec.batch.max):
        model = ExecuTorchInference(program, spec, size, rows_per_call=rows_per_call)
        error = float(np.max(np.abs(model.run(inputs) - expected)))
        assert error <= TOLERANCE, f"rows_per_call={rows_per_call}: max abs error {error:.3g}"
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="rows_per_call"):
            ExecuTorchInference(program, spec, size, rows_per_call=bad)


def test_parity_runs_the_programs_largest_batch(tmp_path, monkeypatch, mobilenet_bundle_32px):
    """Fewer parity images (4) than the bound (8), in calls sliced to 3 rows (as rows_per_call slices
    them: one row at 224 px on one thread): the export ran the program on 2 + 2 rows only, never on
    the 8 it was traced and memory-planned for. The parity check now calls it once with 8 rows too
    (the 4 images repeated), unsliced, and compares every row. The
    lowering is the shared bundle's program (MobileNetV2, 32 px, bound 8: the one this export would
    lower, so the suite does not pay for a second lowering of it); the parity run is the export's own."""
    from edge_client.runtime import executorch_runtime
    from export import pipeline
    from export.executorch_export import LoweredProgram

    shared = read_manifest(mobilenet_bundle_32px / "manifest.json").find("inference", "executorch")
    assert shared.batch.max == 8
    lowered = LoweredProgram((mobilenet_bundle_32px / shared.file).read_bytes(), dict(shared.details["portable_ops"]),
                             shared.details["delegate_calls"])
    monkeypatch.setattr(pipeline, "lower_inference_program", lambda model, example, max_batch: lowered)

    calls, outputs = [], []
    run_batch = executorch_runtime.ExecuTorchInference._run_batch

    def recorded(self, x):
        calls.append(len(x))
        outputs.append(run_batch(self, x))
        return outputs[-1]

    monkeypatch.setattr(executorch_runtime.ExecuTorchInference, "_run_batch", recorded)
    monkeypatch.setattr(executorch_runtime, "default_rows_per_call", lambda image_size, threads: 3)
    parity_images = load_parity_images(count=4)
    manifest = export_bundle("mobilenet_v2", tmp_path / "bundle", num_classes=3, image_size=32, batch_size=8,
                             inference_runtimes=("executorch",), training=False, parity_images=parity_images)
    assert calls == [2, 2, 8]
    # the 8-row call ran the 4 images twice over, and its outputs are eager's for them
    _, expected = eager_features("mobilenet_v2", parity_images.images[[0, 1, 2, 3, 0, 1, 2, 3]], 32)
    assert np.max(np.abs(outputs[-1] - expected)) <= TOLERANCE
    assert read_manifest(manifest).find("inference", "executorch").parity["max_abs_error"] <= TOLERANCE


FIRST_RUNS_ON_THREADS = """
import sys, threading
import numpy as np
from edge_client.runtime import load_inference

barrier = threading.Barrier(8)
def first_run():
    barrier.wait()
    load_inference(sys.argv[1], prefer=("executorch",)).run(np.zeros((2, 3, 32, 32), np.float32))
threads = [threading.Thread(target=first_run) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("every thread ran")
"""


def test_programs_run_first_on_many_threads_at_once_do_not_deadlock(mobilenet_bundle):
    """ExecuTorch makes its threadpool on first use; eight threads running their first program
    at once (an emulated device host's step threads) deadlocked 5 processes of 6 on the GIL and
    the pool's C++ static initialiser before the runtime made the pool up front. A fresh process
    each time: the pool is made once per process."""
    import subprocess

    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", FIRST_RUNS_ON_THREADS, str(mobilenet_bundle)],
                              capture_output=True, text=True, timeout=90)
        assert proc.returncode == 0 and "every thread ran" in proc.stdout, proc.stderr[-2000:]


def test_one_program_run_from_many_threads_at_once_gives_each_its_own_outputs(mobilenet_bundle):
    """A loaded method computes in its memory-planned buffers: four threads calling one runtime at
    once got one another's activations back (39 of 120 calls wrong, by up to 1.8), silently. A
    device's deployment follower extracts held-out features on its own thread with the extractor its
    tasks use. Each thread's outputs must be the single-threaded run's, bit for bit."""
    import threading

    runtime = load_inference(mobilenet_bundle, prefer=("executorch",))
    rng = np.random.default_rng(0)
    inputs = [rng.normal(size=(8, 3, 32, 32)).astype(np.float32) for _ in range(4)]
    expected = [runtime.run(x) for x in inputs]
    barrier, wrong = threading.Barrier(len(inputs)), []

    def calls(i: int) -> None:
        barrier.wait()
        wrong.extend(i for _ in range(30) if not np.array_equal(runtime.run(inputs[i]), expected[i]))

    threads = [threading.Thread(target=calls, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_executorch_threadpool_size_is_settable():
    from edge_client.runtime.executorch_runtime import executorch_threads, set_executorch_threads

    original = executorch_threads()
    try:
        assert set_executorch_threads(1) == 1 == executorch_threads()
    finally:
        set_executorch_threads(original)
    for bad in (0, -2, 1.5, "2", True):
        with pytest.raises(ValueError, match="thread count"):
            set_executorch_threads(bad)


def test_manifest_describes_every_file(bundle):
    name, manifest_path = bundle
    raw = json.loads(manifest_path.read_text())
    manifest = read_manifest(manifest_path)
    backbone = build_backbone(name)
    assert manifest.backbone == name and manifest.weights_sha256 == weights_sha256(name)
    assert manifest.input.image_size == (32 if name == "mobilenet_v2" else IMAGE_SIZE)
    assert np.allclose(manifest.input.mean, backbone.mean)
    assert np.allclose(manifest.input.std, backbone.std)
    assert manifest.temperature == pytest.approx(0.1)
    assert manifest.feature_range == backbone.feature_range == (0.0, 6.0)    # ReLU6 then pooling
    offered = {(spec.kind, spec.runtime) for spec in manifest.artifacts}
    runtimes = ("executorch", "onnxruntime", "eager")
    expected = {("inference", r) for r in runtimes} | {("training", "executorch"), ("training", "eager")}
    if manifest.tail is not None:               # the shared MobileNetV2 bundle: FT(φ)'s programs too
        expected |= {("trunk", r) for r in runtimes} | {("tail_training", "executorch"),
                                                        ("tail_training", "eager"), ("tail_eval", "eager")}
    assert offered == expected
    bundle_dir = manifest_path.parent
    assert sorted(p.name for p in bundle_dir.iterdir()) == sorted(
        [spec.file for spec in manifest.artifacts] + ["manifest.json"])
    for entry in raw["artifacts"]:
        data = (bundle_dir / entry["file"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["size_bytes"] == len(data)
        assert entry["runtime_version"]
    pte = manifest.find("inference", "executorch")
    assert pte.details["delegate"] == "xnnpack" and pte.details["delegate_calls"] == 1
    # The whole graph, global average pooling included, runs inside the XNNPACK delegate.
    assert pte.details["portable_ops"] == {}
    assert pte.batch.max == (8 if name == "mobilenet_v2" else 32) and pte.outputs[0].name == "features"
    assert 0 <= pte.parity["max_abs_error"] <= TOLERANCE
    training = manifest.find("training", "executorch")
    assert training.details["trainable_parameters"] == {"weight": [NUM_CLASSES, 1280],
                                                        "bias": [NUM_CLASSES]}
    assert training.outputs[0].name == "loss"
    assert training.parity["gradient_max_abs_error"] <= 1e-5
    assert training.parity["sgd_max_abs_error"] <= 1e-5


@pytest.fixture
def bundle_copy(mobilenet_bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(mobilenet_bundle.parent, copy)
    return copy / "manifest.json"


def flip_one_byte(path, offset_fraction=0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * offset_fraction)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("runtime,file", [("executorch", "inference_xnnpack.pte"),
                                          ("onnxruntime", "inference.onnx"),
                                          ("eager", "inference_eager.pt")])
def test_tampered_inference_artifact_is_refused(bundle_copy, runtime, file):
    flip_one_byte(bundle_copy.parent / file)
    with pytest.raises(ArtifactTamperedError, match=file):
        load_inference(bundle_copy, prefer=(runtime,))
    # Refused, not silently replaced by another runtime's file.
    with pytest.raises(ArtifactTamperedError):
        load_inference(bundle_copy, prefer=(runtime, "eager" if runtime != "eager" else "onnxruntime"))
    with pytest.raises(ArtifactTamperedError):
        verify_bundle(bundle_copy)


def test_tampered_training_program_is_refused(bundle_copy):
    flip_one_byte(bundle_copy.parent / "head_training.pte", 0.9)
    with pytest.raises(ArtifactTamperedError, match="head_training.pte"):
        TrainingSession.load(bundle_copy)


def test_appended_and_missing_files_are_refused(bundle_copy):
    with open(bundle_copy.parent / "inference.onnx", "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ArtifactTamperedError, match="size differs"):
        load_inference(bundle_copy, prefer=("onnxruntime",))
    (bundle_copy.parent / "inference_xnnpack.pte").unlink()
    with pytest.raises(ArtifactMissingError):
        load_inference(bundle_copy, prefer=("executorch",))


def test_manifest_digest_can_be_pinned(bundle_copy):
    announced = file_sha256(bundle_copy)
    assert load_inference(bundle_copy, prefer=("onnxruntime",),
                          expected_manifest_sha256=announced).runtime == "onnxruntime"
    manifest = json.loads(bundle_copy.read_text())
    # A consistent forgery: file and its digest swapped together. Only the pin catches it.
    forged = bundle_copy.parent / "inference.onnx"
    flip_one_byte(forged)
    for entry in manifest["artifacts"]:
        if entry["file"] == "inference.onnx":
            entry["sha256"] = file_sha256(forged)
    bundle_copy.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactTamperedError, match="manifest"):
        load_inference(bundle_copy, prefer=("onnxruntime",), expected_manifest_sha256=announced)


@pytest.fixture
def without_executorch(monkeypatch):
    """Make `import executorch...` fail as it does where the package is not installed."""
    for module_name in [name for name in sys.modules if name.split(".")[0] == "executorch"]:
        monkeypatch.setitem(sys.modules, module_name, None)
    monkeypatch.setitem(sys.modules, "executorch", None)


def test_missing_runtime_names_the_alternatives(mobilenet_bundle, without_executorch, test_images):
    with pytest.raises(RuntimeUnavailableError) as raised:
        load_inference(mobilenet_bundle, prefer=("executorch",))
    message = str(raised.value)
    assert "pip install executorch==1.5.1" in message
    assert "onnxruntime" in message and "eager" in message
    # With the default preferences the next installed runtime takes over.
    fallback = load_inference(mobilenet_bundle)
    assert fallback.runtime == "onnxruntime"
    inputs, expected = eager_features("mobilenet_v2", test_images[0][:8], read_manifest(mobilenet_bundle).input.image_size)
    assert np.max(np.abs(fallback.run(inputs) - expected)) <= TOLERANCE

    with pytest.raises(RuntimeUnavailableError, match="eager"):
        TrainingSession.load(mobilenet_bundle, prefer=("executorch",))
    assert TrainingSession.load(mobilenet_bundle).runtime == "eager"
