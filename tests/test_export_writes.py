"""The export's writing and reporting on small inputs (no export runs): what ``--overwrite`` may
replace, the CLI's summary of every artifact kind, and the head weights an export takes."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from export.cli import _summary
from export.manifest import describe_artifact, write_bundle
from protocols.bundle_manifest import (
    MANIFEST_FILENAME,
    BatchSpec,
    InputNormalisation,
    Manifest,
    TailSpec,
    TensorSpec,
    read_manifest,
)

FEATURES, CLASSES, SIZE = 8, 3, 32
TAIL = TailSpec(stages=1, activation_shape=(4, 1, 1), parameters={"tail.weight": (FEATURES, 4)})
IMAGES = (TensorSpec("image", "float32", (None, 3, SIZE, SIZE)),)
ACTIVATIONS = (TensorSpec("activations", "float32", (None, 4, 1, 1)),)


def small_manifest(artifacts=()) -> Manifest:
    return Manifest(backbone="mobilenet_v2", weights_sha256="0" * 64, feature_dim=FEATURES, num_classes=CLASSES,
                    temperature=0.1, output="features", input=InputNormalisation(SIZE, (0.5,) * 3, (0.25,) * 3),
                    artifacts=tuple(artifacts), created_with={}, tail=TAIL)


def inference(data: bytes = b"program"):
    return describe_artifact("inference", "eager", "1", "inference_eager.pt", data, BatchSpec(None), IMAGES,
                             (TensorSpec("features", "float32", (None, FEATURES)),), {},
                             {"max_abs_error": 2.5e-6, "tolerance": 1e-4})


def write_small_bundle(out_dir, overwrite=False, data: bytes = b"program"):
    return write_bundle(out_dir, small_manifest([inference(data)]), {"inference_eager.pt": data}, overwrite)


@pytest.mark.parametrize("other_manifest", [
    b'{"manifest_version": 3, "name": "an extension", "background": {"service_worker": "background.js"}}',
    b'{"name": "a web app", "start_url": "/", "display": "standalone"}',
    b"\xff\xfe not JSON, not UTF-8",
    b'{"format": "fedfleet-export", "format": "another tool"}',        # a key twice: no manifest of ours
])
def test_overwrite_never_replaces_a_folder_whose_manifest_json_is_not_an_export(tmp_path, other_manifest):
    """A review's finding: any file named manifest.json (browser extensions and web apps have one)
    made a folder "an earlier export", and --overwrite deleted it whole."""
    folder = tmp_path / "my-extension"
    folder.mkdir()
    (folder / MANIFEST_FILENAME).write_bytes(other_manifest)
    (folder / "background.js").write_text("the user's work")
    with pytest.raises(FileExistsError, match="holds no bundle"):
        write_small_bundle(folder, overwrite=True)
    assert (folder / "background.js").read_text() == "the user's work"
    assert (folder / MANIFEST_FILENAME).read_bytes() == other_manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-extension"]      # no staging left behind


def test_overwrite_never_takes_a_linked_manifest_for_an_earlier_export(tmp_path):
    """A link named manifest.json to a real bundle's manifest does not make the user's folder a bundle."""
    write_small_bundle(tmp_path / "real")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / MANIFEST_FILENAME).symlink_to(tmp_path / "real" / MANIFEST_FILENAME)
    with pytest.raises(FileExistsError, match="holds no bundle"):
        write_small_bundle(folder, overwrite=True)
    assert (folder / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_an_earlier_export_whole(tmp_path):
    out = tmp_path / "bundle"
    write_small_bundle(out, data=b"first")
    (out / "stale.txt").write_text("an earlier export's leftover")
    with pytest.raises(FileExistsError, match="not empty"):
        write_small_bundle(out, data=b"second")
    path = write_small_bundle(out, overwrite=True, data=b"second")
    assert sorted(p.name for p in out.iterdir()) == ["inference_eager.pt", MANIFEST_FILENAME]
    assert read_manifest(path).artifacts[0].sha256 == hashlib.sha256(b"second").hexdigest()
    assert (out / "inference_eager.pt").read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


def test_the_summary_names_every_artifact_kind_of_a_tail_bundle(tmp_path):
    """A review's finding: ``fedfleet export --tail-stages N`` wrote its bundle, then its summary read
    a training program's errors from the trunk's and tail_eval's parity (KeyError): exit 2, "error"."""
    def spec(kind, runtime, file, inputs, outputs, parity, details=None, batch=BatchSpec(None)):
        return describe_artifact(kind, runtime, "1", file, file.encode(), batch, inputs, outputs, details or {},
                                 parity)

    fixed, b = BatchSpec(4, fixed=True), 4
    training_io = ((TensorSpec("features", "float32", (b, FEATURES)), TensorSpec("labels", "int64", (b,)),
                    TensorSpec("sample_weight", "float32", (b,))),
                   (TensorSpec("loss", "float32", ()), TensorSpec("logits", "float32", (b, CLASSES))))
    head = {"weight": [CLASSES, FEATURES], "bias": [CLASSES]}
    artifacts = [
        inference(b"inference_eager.pt"),
        spec("trunk", "eager", "trunk_eager.pt", IMAGES, ACTIVATIONS, {"max_abs_error": 3.0e-7}),
        spec("tail_eval", "eager", "tail_eval.pt2", ACTIVATIONS,
             (TensorSpec("logits", "float32", (None, CLASSES)),), {"max_abs_error": 4.0e-8},
             {"parameters": {"tail.weight": [FEATURES, 4], **head}}),
        spec("training", "eager", "head_training_eager.pt", *training_io,
             {"gradient_max_abs_error": 5.0e-9, "sgd_max_abs_error": 6.0e-9},
             {"trainable_parameters": head}, fixed),
    ]
    manifest = small_manifest(artifacts)
    path = write_bundle(tmp_path / "bundle", manifest, {a.file: a.file.encode() for a in artifacts})
    lines = {line.split()[0]: line for line in _summary(path).splitlines()[2:]}
    assert set(lines) == {a.file for a in artifacts}
    assert "max abs error vs eager 2.50e-06" in lines["inference_eager.pt"]
    assert "max abs error vs eager 3.00e-07" in lines["trunk_eager.pt"]
    assert "max abs error vs eager 4.00e-08" in lines["tail_eval.pt2"]
    assert "gradient error 5.00e-09, SGD error 6.00e-09" in lines["head_training_eager.pt"]


def test_head_weights_beyond_float32_are_refused_not_exported_as_infinities(tmp_path):
    """A review's finding: float64 head weights past float32's range passed the finiteness check and
    became inf in the training programs, whose parity check starts from parameters of its own."""
    from edge_client.runtime.base import check_parameter_dict
    from export.pipeline import ExportError, _load_head

    shapes = {"weight": (CLASSES, FEATURES), "bias": (CLASSES,)}
    huge = {"weight": np.full(shapes["weight"], 1e39), "bias": np.zeros(CLASSES)}
    assert np.isfinite(huge["weight"]).all() and 1e39 > float(np.finfo(np.float32).max)
    with pytest.raises(ValueError, match="'weight' contains NaN or infinite values"):
        check_parameter_dict(huge, shapes)
    np.savez(tmp_path / "head.npz", **huge)
    with pytest.raises(ExportError, match="weight"):
        _load_head(tmp_path / "head.npz", CLASSES, FEATURES)
    # float64 within float32's range is taken, as float32
    fine = {"weight": np.full(shapes["weight"], 3e38), "bias": np.full(CLASSES, -1.5)}
    checked = check_parameter_dict(fine, shapes)
    assert checked["weight"].dtype == np.float32 and np.all(checked["weight"] == np.float32(3e38))
    assert json.dumps(checked["bias"].tolist()) == "[-1.5, -1.5, -1.5]"
