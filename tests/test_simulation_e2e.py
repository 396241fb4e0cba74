"""`fedfleet simulate` end to end: 20 emulated devices (separate processes), mosquitto, the
aggregator process, real Fashion-MNIST images through the pretrained MobileNetV2."""

import dataclasses
import json

import pytest

from fedfleet.simulate import PRESETS, run


@pytest.mark.slow
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
def test_smoke_simulation_matches_centralized_ridge(tmp_path, secure):
    cfg = dataclasses.replace(PRESETS["smoke"], out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"),
                              secure=secure)
    report = run(cfg, quiet=True)
    assert report["devices"] == 20 and report["contributed"] == 20      # drop-outs were retried
    assert report["rel_weight_error"] <= (1e-6 if secure else 1e-9)   # secure: fixed-point resolution
    assert round(report["fed3r_accuracy"], 4) == round(report["central_accuracy"], 4)
    assert report["fed3r_accuracy"] > 0.5                                # far above chance (0.1)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["rejections"] == {}
    # provisional classifiers: one evaluation per contribution, contributions strictly increasing
    counts = [h["contributions"] for h in results["history"]]
    assert counts == sorted(counts) and counts[-1] == 20
