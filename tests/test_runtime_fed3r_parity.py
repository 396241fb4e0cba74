"""Fed3R through the exported ExecuTorch / ONNX programs gives the eager accuracy (issue 4), and
``ensure_bundle`` exports a bundle on first use and reuses it after.

The accuracy test runs the suite's shared 32 px MobileNetV2 bundle (conftest
``mobilenet_bundle_32px``: the backbone, input size and classes ``ensure_bundle`` exports, by the
same exporter, with ExecuTorch and ONNX Runtime inference programs; its batch bound is 8 where
``ensure_bundle`` takes the exporter's default, which the row slicing of the runtimes hides),
placed where ``ensure_bundle`` looks for it, rather than exporting a third MobileNetV2."""

import numpy as np
import pytest

from aggregator.compute.ridge import ClosedFormRidge
from edge_client.data import load_fashion_mnist
from fedfleet.bundles import bundle_dir, ensure_bundle, make_extractor


@pytest.mark.slow
def test_exported_programs_give_eager_fed3r_accuracy(tmp_path, mobilenet_bundle_32px):
    root = tmp_path / "bundles"
    placed = bundle_dir("mobilenet_v2", 32, root)
    placed.parent.mkdir(parents=True)
    placed.symlink_to(mobilenet_bundle_32px, target_is_directory=True)     # read only, never written
    assert ensure_bundle("mobilenet_v2", 32, root) == placed / "manifest.json"

    Xtr, ytr = load_fashion_mnist("train")
    Xte, yte = load_fashion_mnist("test")
    rng = np.random.default_rng(0)
    tr, te = rng.choice(len(ytr), 1500, replace=False), rng.choice(len(yte), 500, replace=False)
    acc = {}
    feats = {}
    for runtime in ("eager", "executorch", "onnxruntime"):
        fx = make_extractor("mobilenet_v2", 32, None, runtime, bundle_root=root)
        Ztr, Zte = fx.extract(Xtr[tr]), fx.extract(Xte[te])
        feats[runtime] = Zte
        acc[runtime] = ClosedFormRidge(lam=0.01, device="cpu").fit(Ztr, ytr[tr], 10).score(Zte, yte[te])
    for runtime in ("executorch", "onnxruntime"):
        assert np.abs(feats[runtime] - feats["eager"]).max() < 1e-4
        assert abs(acc[runtime] - acc["eager"]) <= 1e-3
    assert acc["eager"] > 0.6


def test_a_missing_bundle_is_exported_once_then_reused(tmp_path):
    """The export-on-first-use path itself, on the cheapest bundle it can make (eager only): the
    first call exports, the second finds the manifest and exports nothing."""
    from fedfleet.bundles import _exported_once

    out = tmp_path / "bundles" / "mobilenet-eager"
    args = dict(backbone="mobilenet_v2", num_classes=10, image_size=32, inference_runtimes=("eager",),
                training=False)
    manifest = _exported_once(out, args)
    assert manifest == out / "manifest.json" and (out / "inference_eager.pt").exists()
    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert _exported_once(out, args) == manifest
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == written
