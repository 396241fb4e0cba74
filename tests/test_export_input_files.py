"""The files an export reads (``--weights``, the default pretrained weights, ``--parity-images``) and
its image counts, on small inputs (one eager-only export): each file is read once, as a regular file
of bounded size, and a bad count is a bad argument."""

from __future__ import annotations

import hashlib
import os
import threading

import numpy as np
import pytest
import torch

import edge_client.models
from edge_client.models import build_backbone, weights_path
from export import export_bundle, pipeline
from export.cli import main
from export.parity import load_calibration_images, load_parity_images
from export.request import ExportError
from opened_files import opened_files
from protocols.bundle_manifest import read_manifest


def _without_blocking(call, fifo):
    """``call()``'s result or exception; fails the test when it waits on ``fifo`` (a writer is then
    opened, so the blocked reader sees an empty file and the thread ends)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except Exception as error:      # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        with open(fifo, "wb"):
            pass
        thread.join(20)
        pytest.fail(f"blocked on the FIFO {fifo}")
    return outcome


def test_the_weights_digest_is_that_of_the_bytes_loaded(tmp_path, monkeypatch):
    """A review's finding: ``torch.load`` read the --weights file, then ``file_sha256`` read it again,
    so the weights_sha256 recorded (devices and feature caches are keyed on it) could describe bytes
    other than those loaded. Here the file changes as soon as torch has loaded it."""
    torch.manual_seed(3)
    state = build_backbone("mobilenet_v2", pretrained=False).state_dict()
    path = tmp_path / "w.pt"
    torch.save(state, path)
    loaded_bytes = path.read_bytes()
    real_load = torch.load

    def load_then_file_changes(*args, **kwargs):
        result = real_load(*args, **kwargs)
        path.write_bytes(b"other bytes, written after the load")
        return result

    monkeypatch.setattr(torch, "load", load_then_file_changes)
    backbone, digest = pipeline._load_backbone("mobilenet_v2", path)
    assert digest == hashlib.sha256(loaded_bytes).hexdigest()
    name = next(iter(state))
    torch.testing.assert_close(backbone.state_dict()[name], state[name], rtol=0, atol=0)


def test_an_export_reads_the_default_pretrained_weights_once(tmp_path):
    """The default weights were hashed (weights_sha256), then loaded by path (torch.load): two reads of
    the file per export, and a digest that need not be that of the bytes loaded."""
    weights = os.path.realpath(weights_path("mobilenet_v2"))
    edge_client.models._file_sha256.cache_clear()   # as in a new process: no digest cached by another test
    with opened_files() as opened:
        manifest = export_bundle("mobilenet_v2", tmp_path / "bundle", num_classes=3, image_size=32,
                                 inference_runtimes=("eager",), training=False,
                                 parity_images=load_parity_images(count=4))
    assert opened.count(weights) == 1
    with open(weights, "rb") as file:
        assert read_manifest(manifest).weights_sha256 == hashlib.sha256(file.read()).hexdigest()


def test_weights_that_are_a_fifo_or_too_large_are_refused_at_once(tmp_path, monkeypatch):
    fifo = tmp_path / "w.pt"
    os.mkfifo(fifo)
    outcome = _without_blocking(lambda: pipeline._load_backbone("mobilenet_v2", fifo), fifo)
    assert isinstance(outcome.get("error"), ExportError) and "is not a regular file" in str(outcome["error"])
    large = tmp_path / "large.pt"
    large.write_bytes(bytes(101))
    monkeypatch.setattr(pipeline, "MAX_WEIGHTS_FILE_BYTES", 100)
    with pytest.raises(ExportError, match="has 101 bytes, more than 100"):
        pipeline._load_backbone("mobilenet_v2", large)


def test_parity_images_from_a_fifo_or_a_file_too_large_are_refused_at_once(tmp_path, monkeypatch):
    """A review's finding: a .npy of parity images was read by np.load, unbounded, and a FIFO blocked it."""
    fifo = tmp_path / "images.npy"
    os.mkfifo(fifo)
    outcome = _without_blocking(lambda: load_parity_images(fifo, count=4), fifo)
    assert isinstance(outcome.get("error"), ValueError) and "is not a regular file" in str(outcome["error"])
    images = np.arange(5 * 4 * 4, dtype=np.uint8).reshape(5, 4, 4)
    np.save(tmp_path / "ok.npy", images)
    got = load_calibration_images(tmp_path / "ok.npy", count=3)
    np.testing.assert_array_equal(got.images, images[:3])
    import edge_client.data.idx

    monkeypatch.setattr(edge_client.data.idx, "MAX_IDX_BYTES", 100)
    with pytest.raises(ValueError, match="more than 100"):
        load_parity_images(tmp_path / "ok.npy", count=3)


def test_a_parity_header_declaring_more_than_the_file_holds_is_refused_before_allocating(tmp_path):
    import io

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False,
                                                  "shape": (10 ** 7, 10 ** 4, 10 ** 4)})
    (tmp_path / "huge.npy").write_bytes(header.getvalue() + bytes(64))
    with pytest.raises(ValueError, match=r"declares \(10000000, 10000, 10000\)"):
        load_parity_images(tmp_path / "huge.npy", count=3)


@pytest.mark.parametrize("option", ["--parity-count", "--calibration-count"])
@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_image_count_is_a_bad_argument(tmp_path, capsys, option, value):
    """A review's finding: --parity-count 0 exited 1, as an export that failed; a bad argument is 2."""
    out = tmp_path / "bundle"
    quantize = ["--quantize", "int8"] if option == "--calibration-count" else []
    assert main(["--backbone", "mobilenet_v2", "--num-classes", "3", "--out", str(out), *quantize,
                 option, value]) == 2
    assert option in capsys.readouterr().err
    assert not out.exists()
