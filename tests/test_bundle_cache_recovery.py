"""The bundle cache (``fedfleet.bundles``) recovers from what stands under a bundle's name without a
manifest (a review's finding: the export refuses a non-empty folder, so each later run exported in
full and then failed "not empty", for good). It is moved aside, kept, and the bundle exported
again. The export is a stand-in that writes a small bundle with the real ``write_bundle``."""

from __future__ import annotations

import logging

import pytest

import export
from export.manifest import describe_artifact, write_bundle
from fedfleet.bundles import _exported_once
from protocols.bundle_manifest import BatchSpec, InputNormalisation, Manifest, TensorSpec

PROGRAM = b"program"


def _small_export(out_dir, **_):
    spec = describe_artifact("inference", "eager", "1", "inference_eager.pt", PROGRAM, BatchSpec(None),
                             (TensorSpec("image", "float32", (None, 3, 32, 32)),),
                             (TensorSpec("features", "float32", (None, 4)),), {})
    manifest = Manifest(backbone="mobilenet_v2", weights_sha256="0" * 64, feature_dim=4, num_classes=2,
                        temperature=0.1, output="features", input=InputNormalisation(32, (0.5,) * 3, (0.25,) * 3),
                        artifacts=(spec,), created_with={})
    return write_bundle(out_dir, manifest, {"inference_eager.pt": PROGRAM})


@pytest.mark.parametrize("stale", ["folder", "file"])
def test_what_stands_under_a_bundles_name_without_a_manifest_is_moved_aside_and_kept(tmp_path, monkeypatch,
                                                                                       caplog, stale):
    monkeypatch.setattr(export, "export_bundle", _small_export)
    out = tmp_path / "bundles" / "mobilenet_v2-32px"
    out.parent.mkdir()
    if stale == "folder":
        out.mkdir()
        (out / "inference_eager.pt").write_bytes(b"half a program")      # its manifest gone
    else:
        out.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="fedfleet.bundles"):
        manifest = _exported_once(out, {})
    assert manifest == out / "manifest.json" and (out / "inference_eager.pt").read_bytes() == PROGRAM
    (aside,) = out.parent.glob(".mobilenet_v2-32px.stale-*")
    kept = aside / out.name
    assert (kept / "inference_eager.pt").read_bytes() == b"half a program" if stale == "folder" \
        else kept.read_text() == "not a folder"
    assert str(kept) in caplog.text
    assert _exported_once(out, {}) == manifest                                 # reused: nothing moved again
    assert len(list(out.parent.glob(".mobilenet_v2-32px.stale-*"))) == 1


def test_an_empty_folder_under_a_bundles_name_is_exported_into(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "export_bundle", _small_export)
    out = tmp_path / "mobilenet_v2-32px"
    out.mkdir()
    assert _exported_once(out, {}) == out / "manifest.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mobilenet_v2-32px.lock", "mobilenet_v2-32px"]
