"""``fedfleet export`` command line: exit codes, full-model (logits) bundles, refusals."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from edge_client.data.idx import load_fashion_mnist
from edge_client.models import build_backbone
from edge_client.models.preprocess import to_model_input
from edge_client.runtime import load_inference, read_manifest
from export.cli import main

IMAGE_SIZE = 32
FAST = ["--image-size", str(IMAGE_SIZE), "--parity-count", "8", "--batch-size", "4"]


@pytest.fixture(scope="module")
def head_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    head = {"weight": rng.normal(0, 0.05, (4, 1280)).astype(np.float32),
            "bias": rng.normal(0, 0.05, 4).astype(np.float32)}
    path = tmp_path_factory.mktemp("head") / "head.npz"
    np.savez(path, **head)
    return path, head


def test_full_model_outputs_logits_of_the_given_head(tmp_path, head_file, capsys):
    path, head = head_file
    out = tmp_path / "bundle"
    code = main(["--backbone", "mobilenet_v2", "--num-classes", "4", "--out", str(out),
                 "--runtimes", "eager", "--no-training", "--full-model",
                 "--head-weights", str(path), *FAST])
    assert code == 0
    assert "inference_eager.pt" in capsys.readouterr().out
    manifest = read_manifest(out)
    assert manifest.output == "logits" and manifest.num_classes == 4
    runtime = load_inference(out / "manifest.json")
    images = load_fashion_mnist("test")[0][:5]
    backbone = build_backbone("mobilenet_v2")
    inputs = to_model_input(images, IMAGE_SIZE, backbone.mean, backbone.std)
    with torch.no_grad():
        features = backbone(torch.from_numpy(inputs)).numpy().astype(np.float64)
    expected = features @ head["weight"].T.astype(np.float64) + head["bias"]
    np.testing.assert_allclose(runtime.run(inputs), expected, atol=1e-4)


@pytest.mark.parametrize("arguments,message", [
    (["--backbone", "resnet50", "--num-classes", "3"], "unknown backbone"),
    (["--backbone", "mobilenet_v2", "--num-classes", "0"], "num_classes"),
    (["--backbone", "mobilenet_v2", "--num-classes", "3", "--runtimes", "tflite"], "runtimes"),
    (["--backbone", "mobilenet_v2", "--num-classes", "3", "--full-model"], "head weights"),
    (["--backbone", "mobilenet_v2", "--num-classes", "3", "--temperature", "nan"], "temperature"),
    (["--backbone", "mobilenet_v2", "--num-classes", "3", "--runtimes", "",
      "--no-training"], "nothing to export"),
    # a review's findings: terabytes asked for before anything was checked (a MemoryError traceback)
    (["--backbone", "mobilenet_v2", "--num-classes", str(10 ** 9)], "num_classes must be at most 100000"),
    (["--backbone", "mobilenet_v2", "--num-classes", "3", "--image-size", "100000"], "image_size must be at most"),
])
def test_bad_requests_exit_2_and_write_nothing(tmp_path, capsys, arguments, message):
    out = tmp_path / "bundle"
    fast = FAST[2:] if "--image-size" in arguments else FAST
    assert main([*arguments, "--out", str(out), *fast]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_weights_that_are_no_model_file_are_one_error(tmp_path, capsys):
    """A review's finding: a --weights file that is not a torch file was an IndexError traceback
    out of torch's unpickler; a --head-weights archive declaring a huge shape a MemoryError."""
    import zipfile

    (tmp_path / "w.pt").write_bytes(b"PK\x03\x04 not a torch file at all" * 10)
    assert main(["--backbone", "mobilenet_v2", "--num-classes", "3", "--out", str(tmp_path / "a"),
                 "--weights", str(tmp_path / "w.pt"), "--runtimes", "eager", *FAST]) == 2
    assert "cannot load mobilenet_v2 weights" in capsys.readouterr().err
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10 ** 11,)})
    with zipfile.ZipFile(tmp_path / "head.npz", "w") as archive:
        archive.writestr("weight.npy", header.getvalue() + bytes(64))
    assert main(["--backbone", "mobilenet_v2", "--num-classes", "3", "--out", str(tmp_path / "b"),
                 "--head-weights", str(tmp_path / "head.npz"), "--runtimes", "eager", *FAST]) == 2
    assert "declares (100000000000,)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.npz", "w.pt"]


def test_head_weights_of_the_wrong_shape_are_refused(tmp_path, capsys):
    np.savez(tmp_path / "head.npz", weight=np.zeros((3, 10), np.float32), bias=np.zeros(3, np.float32))
    assert main(["--backbone", "mobilenet_v2", "--num-classes", "3", "--out", str(tmp_path / "b"),
                 "--head-weights", str(tmp_path / "head.npz"), "--runtimes", "eager", *FAST]) == 2
    assert "shape" in capsys.readouterr().err


def test_parity_failure_exits_1_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "bundle"
    code = main(["--backbone", "mobilenet_v2", "--num-classes", "3", "--out", str(out),
                 "--runtimes", "", "--gradient-tolerance", "1e-12", *FAST])
    assert code == 1
    err = capsys.readouterr().err
    assert "no artifact written" in err and "gradient_max_abs_error" in err
    assert list(tmp_path.iterdir()) == []


def test_existing_bundle_is_kept_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    arguments = ["--backbone", "mobilenet_v2", "--num-classes", "3", "--out", str(out),
                 "--runtimes", "eager", "--no-training", *FAST]
    assert main(arguments) == 1
    assert "not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    # a review's finding: --overwrite replaced any folder, bundle or not (a user's files went)
    assert main([*arguments, "--overwrite"]) == 1
    assert "holds no bundle" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    assert main(arguments) == 0                                 # an empty folder takes a bundle
    (out / "stale.txt").write_text("an earlier export's leftover")
    assert main([*arguments, "--overwrite"]) == 0               # an earlier export is replaced whole
    assert sorted(p.name for p in out.iterdir()) == ["inference_eager.pt", "manifest.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]  # no staging leftovers


def test_missing_parity_images_exit_1(tmp_path, capsys):
    code = main(["--backbone", "mobilenet_v2", "--num-classes", "3", "--out", str(tmp_path / "b"),
                 "--parity-images", str(tmp_path / "absent.npy"), *FAST])
    assert code == 1
    assert "absent.npy" in capsys.readouterr().err


def test_help_exits_0(capsys):
    from export.request import INT8_RELATIVE_ERROR_TOLERANCE

    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--backbone" in out
    # the help is built without torch, so it says the int8 tolerance's value itself: the same value
    assert f"(default: {INT8_RELATIVE_ERROR_TOLERANCE}, export.request.INT8_RELATIVE_ERROR_TOLERANCE)" in out
