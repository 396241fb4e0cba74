"""``fedfleet simulate --pipeline fed3r-ft-oll --deploy`` at the smoke size (issue 29): the fine-tuned
head reaches every emulated device through a seeded canary and widening stages, and the same head
with permuted classes is rolled back by the guard. The canary, the versions per stage and the
held-out accuracy the canary reported are recomputed here: the cohort from sha256 of the device
ids, the accuracy from the saved head pruned to each canary device's training labels (the devices
personalise: OLL) and its held-out images."""

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from edge_client.data import load_fashion_mnist
from fedfleet.simulate import PRESETS
from protocols.payloads.deployment import head_npz


@pytest.mark.slow
def test_the_pipeline_rolls_the_fine_tuned_head_out_and_a_broken_one_back(tmp_path):
    from fedfleet.bundles import make_extractor
    from fedfleet.pipeline import run_pipeline

    cfg = dataclasses.replace(PRESETS["smoke"], out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"),
                              ft_rounds=2, fp_epochs=1, deploy=True)
    report = run_pipeline(cfg, quiet=True)
    out = tmp_path / "run"
    model = np.load(out / "2-fedavg-ft" / "model.npz")
    W, b = model["weight"], model["bias"]
    sha = hashlib.sha256(head_npz(W, b)).hexdigest()[:12]
    devices = sorted(np.load(out / "holdout.npz").files)
    canary = [d for d in devices
              if int.from_bytes(hashlib.sha256(f"0:{d}".encode()).digest()[:8], "big") < 0.2 * 2 ** 64]
    assert 0 < len(canary) < len(devices)

    good, broken = report["deployments"]["fine-tuned"], report["deployments"]["broken"]
    assert good["state"] == "complete" and good["final_versions"] == {sha: len(devices)}
    assert [(s["state"], s["stage"]) for s in good["stages"]] == [("canary", 0), ("widening", 1), ("widening", 2),
                                                                    ("complete", 2)]
    assert good["stages"][0]["versions"] == {sha: len(canary), "none": len(devices) - len(canary)}

    # the canary's pooled held-out accuracy, recomputed from its devices' images and the saved head
    extractor = make_extractor(cfg.backbone, cfg.image_size, cfg.cache_dir, cfg.runtime)
    images, labels = load_fashion_mnist("train")
    holdouts, shards = np.load(out / "holdout.npz"), np.load(out / "shards.npz")
    W32, b32 = W.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)

    def oll_right(d):              # only the rows of the device's training classes compete
        rows = np.unique(labels[shards[d]])
        pred = rows[(extractor.extract(images[holdouts[d]]) @ W32[rows].T + b32[rows]).argmax(1)]
        return int((pred == labels[holdouts[d]]).sum())

    def pooled(devices):
        return 100 * sum(oll_right(d) for d in devices) / sum(len(holdouts[d]) for d in devices)
    assert good["stages"][0]["reports"] == len(canary) and good["stages"][0]["judged"] == canary
    assert good["stages"][0]["wma_candidate"] == pytest.approx(pooled(canary), abs=1e-9)

    # the broken head may be judged before every canary device reports (the guard needs min_reports);
    # what it judged is the fine-tuned head's accuracy on the devices that did
    judged = broken["stages"][0]["judged"]
    assert set(judged) <= set(canary) and len(judged) == broken["stages"][0]["reports"] >= 1
    assert broken["state"] == "rolled_back" and "guard wma_drop<=1 failed" in broken["reason"]
    assert broken["stages"][0]["wma_current"] == pytest.approx(pooled(judged), abs=1e-9)
    assert broken["stages"][0]["wma_candidate"] < broken["stages"][0]["wma_current"] - 1
    assert broken["final_versions"] == {sha: len(devices)}           # every canary device went back
    assert json.loads((out / "report.json").read_text())["deployments"]["broken"]["state"] == "rolled_back"
    page = (out / "report.html").read_text()
    assert '<table id="deployments">' in page and "guard wma_drop&lt;=1 failed" in page
