"""Runtime layer on a small real bundle (eager inference + training programs, 32 px):
manifest validation, input checks, runtime preference handling."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edge_client.data.idx import load_fashion_mnist
from edge_client.models import build_backbone
from edge_client.models.preprocess import to_model_input
from edge_client.runtime import (
    InferenceRuntime,
    ManifestError,
    RuntimeUnavailableError,
    TrainingSession,
    load_inference,
    read_manifest,
)
from protocols.bundle_manifest import Manifest
from export import export_bundle
from export.parity import load_parity_images

IMAGE_SIZE = 32


@pytest.fixture(scope="module")
def manifest_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "bundle"
    return export_bundle("mobilenet_v2", out, num_classes=3, image_size=IMAGE_SIZE,
                         inference_runtimes=("eager",), batch_size=4,
                         parity_images=load_parity_images(count=8))


@pytest.fixture
def edited_manifest(manifest_path, tmp_path):
    """Write a modified copy of the manifest next to the original files; returns its path."""
    def edit(change):
        data = json.loads(manifest_path.read_text())
        change(data)
        edited = manifest_path.parent / f"edited-{tmp_path.name}.json"
        edited.write_text(json.dumps(data) if not isinstance(data, str) else data)
        return edited
    return edit


def test_manifest_round_trips(manifest_path):
    manifest = read_manifest(manifest_path)
    assert Manifest.from_json(manifest.to_json(), manifest.directory) == manifest
    assert read_manifest(manifest_path.parent) == manifest  # directory or file


def first_artifact(data):
    return data["artifacts"][0]


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(format_version=2), "format_version"),
    (lambda d: first_artifact(d).update(file="../escape.pt"), "file"),
    (lambda d: first_artifact(d).update(file="sub/dir.pt"), "file"),
    (lambda d: first_artifact(d).update(sha256="not-a-digest"), "sha256"),
    (lambda d: first_artifact(d).update(runtime="tflite"), "runtime"),
    (lambda d: first_artifact(d).pop("sha256"), "sha256"),
    (lambda d: d["artifacts"].append(dict(first_artifact(d))), "twice"),
    (lambda d: first_artifact(d)["outputs"][0].update(shape=[None, 7]), "output"),
    (lambda d: d["artifacts"][-1]["details"].update(trainable_parameters={"weight": [3, 5]}),
     "trainable_parameters"),
    (lambda d: d["input"].update(std=[1.0, 0.0, 1.0]), "std"),
    (lambda d: d["artifacts"][-1]["inputs"][0].update(shape=[8, 1280]), "leads with its fixed batch 4"),
    (lambda d: d.update(extra=1), "extra"),
])
def test_invalid_manifests_are_rejected(edited_manifest, change, message):
    with pytest.raises(ManifestError, match=message):
        load_inference(edited_manifest(change))


def test_unparseable_manifests_are_rejected(manifest_path, tmp_path):
    text = manifest_path.read_text()
    cases = {
        "truncated.json": text[: len(text) // 2],
        "nan.json": text.replace('"temperature": 0.1', '"temperature": NaN'),
        "binary.json": "\udcff",
        "huge.json": " " * (1 << 20) + text,
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content.encode("utf-8", "surrogateescape"))
        with pytest.raises(ManifestError):
            read_manifest(path)
    with pytest.raises(ManifestError, match="no manifest"):
        read_manifest(tmp_path / "absent.json")


@pytest.fixture(scope="module")
def images():
    return load_fashion_mnist("test")[0][:6]


def test_eager_runtime_matches_backbone(manifest_path, images):
    runtime = load_inference(manifest_path)
    assert isinstance(runtime, InferenceRuntime) and runtime.runtime == "eager"
    backbone = build_backbone("mobilenet_v2")
    inputs = to_model_input(images, IMAGE_SIZE, runtime.manifest.input.mean,
                            runtime.manifest.input.std)
    with torch.no_grad():
        expected = backbone(torch.from_numpy(inputs)).numpy()
    np.testing.assert_array_equal(runtime.run(inputs), expected)


def test_bad_inference_inputs_are_rejected(manifest_path):
    runtime = load_inference(manifest_path)
    good = np.zeros((2, 3, IMAGE_SIZE, IMAGE_SIZE), np.float32)
    nan = good.copy()
    nan[1, 2, 3, 4] = np.inf
    cases = [
        (good[0], ValueError, "shape"),
        (np.zeros((2, 3, IMAGE_SIZE + 1, IMAGE_SIZE), np.float32), ValueError, "shape"),
        (np.zeros((2, IMAGE_SIZE, IMAGE_SIZE, 3), np.float32), ValueError, "NCHW"),
        (good[:0], ValueError, "empty"),
        (good.astype(np.float64), ValueError, "float32"),
        (nan, ValueError, "NaN"),
        (good.tolist(), TypeError, "numpy"),
    ]
    for value, error, message in cases:
        with pytest.raises(error, match=message):
            runtime.run(value)


def test_runtime_preferences_are_checked(manifest_path):
    with pytest.raises(TypeError):
        load_inference(manifest_path, prefer="eager")  # a string, not a sequence of names
    with pytest.raises(TypeError):
        load_inference(manifest_path, prefer=())
    with pytest.raises(ValueError, match="tflite"):
        load_inference(manifest_path, prefer=("tflite",))
    with pytest.raises(ValueError, match="onnxruntime"):
        TrainingSession.load(manifest_path, prefer=("onnxruntime",))  # no ORT training


def test_runtime_absent_from_bundle_names_what_it_offers(manifest_path):
    with pytest.raises(RuntimeUnavailableError) as raised:
        load_inference(manifest_path, prefer=("executorch", "onnxruntime"))
    message = str(raised.value)
    assert "no inference artifact" in message
    assert "['eager']" in message and "pip install torch" in message


@pytest.mark.parametrize("rows,batch_max,rows_per_call,expected", [
    (45, 32, None, [23, 22]),  # equal slices, not 32 + 13
    (32, 32, None, [32]),
    (32, 32, 8, [8, 8, 8, 8]),
    (10, None, 4, [4, 3, 3]),
    (5, None, None, [5]),
])
def test_batches_are_split_into_equal_slices(rows, batch_max, rows_per_call, expected):
    from edge_client.runtime.base import run_in_batches
    from protocols.bundle_manifest import BatchSpec

    class Spec:
        batch = BatchSpec(max=batch_max)

    seen = []

    def double(x):
        seen.append(len(x))
        return x * 2

    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    np.testing.assert_array_equal(run_in_batches(double, x, Spec, rows_per_call), x * 2)
    assert seen == expected


def test_one_call_runs_the_programs_bound_unsliced_and_refuses_beyond_it():
    """``run`` slices as a device runs (the bound, then rows_per_call); ``run_one_call`` hands the
    whole batch to the program in one call (the parity check's call at the traced batch), and a batch
    beyond the bound is refused before the program sees it."""
    from edge_client.runtime.base import BatchedInference
    from protocols.bundle_manifest import BatchSpec

    class Spec:
        batch = BatchSpec(max=8)

    class Doubling(BatchedInference):
        runtime, rows_per_call, _spec, _image_size = "test", 3, Spec, 2

        def __init__(self):
            self.calls = []

        def _run_batch(self, x):
            self.calls.append(len(x))
            return x * 2

    x = np.arange(8 * 12, dtype=np.float32).reshape(8, 3, 2, 2)
    runtime = Doubling()
    np.testing.assert_array_equal(runtime.run(x), x * 2)
    np.testing.assert_array_equal(runtime.run_one_call(x), x * 2)
    assert runtime.calls == [3, 3, 2, 8]
    with pytest.raises(ValueError, match="9 rows exceed the program's batch bound 8"):
        runtime.run_one_call(np.zeros((9, 3, 2, 2), np.float32))
    with pytest.raises(ValueError, match="shape"):
        runtime.run_one_call(np.zeros((2, 3, 4, 4), np.float32))
    assert runtime.calls == [3, 3, 2, 8]
