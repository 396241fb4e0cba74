"""``fedfleet features``: the evaluation-features file made from IDX files or an image folder
through an exported bundle's ONNX program, checked against the eager torch backbone (an
independent runtime) and read back by the aggregator's own --eval-features reader."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from aggregator.cli import read_eval_features
from edge_client.data import load_fashion_mnist
from edge_client.features import FeatureExtractor
from fedfleet.cli import main

SIZE, N = 32, 48
CLASSES = ["tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]


def write_idx(path, array):
    path.write_bytes(struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
                     + array.astype(np.uint8).tobytes())


@pytest.fixture(scope="module")
def bundle(onnx_bundle_32px):
    return onnx_bundle_32px


def test_features_from_idx_and_from_a_subset_image_folder_match_the_eager_backbone(bundle, tmp_path, capsys):
    from PIL import Image

    images, labels = load_fashion_mnist("test")
    pick = np.flatnonzero(np.isin(labels, [3, 7]))[:N]
    write_idx(tmp_path / "images.idx", images[pick])
    write_idx(tmp_path / "labels.idx", labels[pick])
    assert main(["features", "--idx", str(tmp_path / "images.idx"), str(tmp_path / "labels.idx"),
                 "--bundle", str(bundle), "-o", str(tmp_path / "eval.npz")]) == 0
    assert "feature_dim 1280" in capsys.readouterr().out
    Z, y = read_eval_features(tmp_path / "eval.npz")             # what aggregator serve would load
    reference = FeatureExtractor.eager("mobilenet_v2", image_size=SIZE).extract(images[pick])
    assert Z.dtype == np.float32 and Z.shape == (N, 1280) and np.array_equal(y, labels[pick])
    assert np.linalg.norm(Z - reference) / np.linalg.norm(reference) < 1e-4

    # the same images as a folder holding only two of the ten classes: labels are the job's ids
    for i, (img, label) in enumerate(zip(images[pick], labels[pick])):
        (tmp_path / "folder" / CLASSES[label]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(tmp_path / "folder" / CLASSES[label] / f"{i:03d}.png")
    assert main(["features", "--image-folder", str(tmp_path / "folder"), "--classes", ",".join(CLASSES),
                 "--bundle", str(bundle / "manifest.json"), "-o", str(tmp_path / "folder.npz")]) == 0
    Zf, yf = read_eval_features(tmp_path / "folder.npz")
    order = np.argsort(y, kind="stable")            # the folder is read class by class, files in name order
    assert np.array_equal(yf, y[order])
    assert np.linalg.norm(Zf - Z[order]) <= 1e-5 * np.linalg.norm(Z)


def junk_bundle(folder, program: bytes) -> None:
    """A bundle whose ONNX artifact is ``program``, listed with its true sha256 and size."""
    import hashlib

    from protocols.bundle_manifest import ArtifactSpec, BatchSpec, InputNormalisation, Manifest, TensorSpec

    spec = ArtifactSpec(kind="inference", runtime="onnxruntime", runtime_version="1.0", file="inference.onnx",
                        sha256=hashlib.sha256(program).hexdigest(), size_bytes=len(program), batch=BatchSpec(None),
                        inputs=(TensorSpec("image", "float32", (None, 3, SIZE, SIZE)),),
                        outputs=(TensorSpec("features", "float32", (None, 1280)),), parity={}, details={})
    manifest = Manifest(backbone="mobilenet_v2", weights_sha256="0" * 64, feature_dim=1280, num_classes=10,
                        temperature=0.1, output="features",
                        input=InputNormalisation(image_size=SIZE, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)),
                        artifacts=(spec,), created_with={})
    folder.mkdir()
    (folder / "manifest.json").write_text(manifest.dumps())
    (folder / "inference.onnx").write_bytes(program)


@pytest.mark.parametrize("argv, message", [
    (["--image-folder", "{tmp}", "--bundle", "{tmp}"], "needs --classes"),
    (["--idx", "{tmp}/none.idx", "{tmp}/none.idx", "--bundle", "{tmp}"], "none.idx"),
    (["--idx", "{tmp}/a.idx", "{tmp}/b.idx", "--bundle", "{tmp}/nothing"], "no manifest.json"),
    (["--idx", "{tmp}/a.idx", "{tmp}/b.idx", "--backbone", "resnet999"], "not one of"),
    # a review's finding: an artifact of other bytes than a program (its sha256 and size the manifest's)
    # was a RuntimeUnavailableError traceback
    (["--idx", "{tmp}/a.idx", "{tmp}/b.idx", "--bundle", "{tmp}/junk", "--runtime", "onnxruntime"],
     "could not load inference.onnx"),
])
def test_features_mistakes_get_one_line(tmp_path, capsys, argv, message):
    images, labels = load_fashion_mnist("test")
    write_idx(tmp_path / "a.idx", images[:4])
    write_idx(tmp_path / "b.idx", labels[:4])
    junk_bundle(tmp_path / "junk", b"not an onnx model" * 10)
    rc = main(["features", *[a.format(tmp=tmp_path) for a in argv], "-o", str(tmp_path / "x.npz")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "x.npz").exists()
