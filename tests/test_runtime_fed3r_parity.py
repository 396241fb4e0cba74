"""Fed3R through the exported ExecuTorch / ONNX programs gives the eager accuracy (issue 4)."""

import numpy as np
import pytest

from aggregator.compute.ridge import ClosedFormRidge
from edge_client.data import load_fashion_mnist
from fedfleet.bundles import ensure_bundle, make_extractor


@pytest.mark.slow
def test_exported_programs_give_eager_fed3r_accuracy(tmp_path):
    Xtr, ytr = load_fashion_mnist("train")
    Xte, yte = load_fashion_mnist("test")
    rng = np.random.default_rng(0)
    tr, te = rng.choice(len(ytr), 1500, replace=False), rng.choice(len(yte), 500, replace=False)
    manifest = ensure_bundle("mobilenet_v2", 32, tmp_path / "bundles")
    assert ensure_bundle("mobilenet_v2", 32, tmp_path / "bundles") == manifest      # reused, not re-exported
    acc = {}
    feats = {}
    for runtime in ("eager", "executorch", "onnxruntime"):
        fx = make_extractor("mobilenet_v2", 32, None, runtime, bundle_root=tmp_path / "bundles")
        Ztr, Zte = fx.extract(Xtr[tr]), fx.extract(Xte[te])
        feats[runtime] = Zte
        acc[runtime] = ClosedFormRidge(lam=0.01, device="cpu").fit(Ztr, ytr[tr], 10).score(Zte, yte[te])
    for runtime in ("executorch", "onnxruntime"):
        assert np.abs(feats[runtime] - feats["eager"]).max() < 1e-4
        assert abs(acc[runtime] - acc["eager"]) <= 1e-3
    assert acc["eager"] > 0.6
