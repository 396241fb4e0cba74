"""`fedfleet simulate` end to end: 20 emulated devices (separate processes), mosquitto, the
aggregator process, real Fashion-MNIST images through the pretrained MobileNetV2."""

import dataclasses
import json

import pytest

from fedfleet.sim_config import PRESETS

# the smoke preset on 1,200 of its 3,000 training images and 300 test images: every run here asks

from fedfleet.simulate import run

# the smoke preset on 1,200 of its 3,000 training images and 300 test images: every run here asks
# each of the 20 devices for its work over the same broker paths, on less data (the suite's time)
SMOKE = dataclasses.replace(PRESETS["smoke"], train_limit=1200, test_limit=300)


@pytest.fixture(scope="module")
def feature_cache(tmp_path_factory):
    """One feature cache for the module's runs: they all run the smoke fleet (the same images, split
    and eager MobileNetV2), so the first run extracts and the later ones read. The cache is keyed by
    the model and the images' bytes (edge_client/features.py), so a run never reads another
    model's features; what a run fine-tunes (FT(φ)'s tail) is extracted apart, never cached."""
    return str(tmp_path_factory.mktemp("smoke-features"))


@pytest.mark.slow
@pytest.mark.parametrize("secure", [False, True], ids=["central", "secure"])
def test_simulate_dp_epsilon_runs_dp_fed3r_with_a_private_center_on_the_devices(tmp_path, feature_cache, secure):
    """``fedfleet simulate [--secure] --dp-epsilon ε --dp-center-devices m``: a center round of m
    devices, then the model's: central DP in the preset's rounds of κ, their sums released once at
    the end, Fed3R-Sync's distributed DP in groups of κ; the job accounts one release at the
    smallest multiplier its own accountant allows for ε at δ = 1/devices (PLD central, RDP secure),
    and the report puts the private model beside the centralized ridge. (``--dp-release round``'s
    one round of everyone: test_dp_release_at_end.py builds its config, test_dp_fed3r_center.py
    holds a job's rounds to its ``dp_min_round_devices``.)"""
    from aggregator.compute.privacy import noise_multiplier_for
    from fedfleet.simulate_report import format_report

    cfg = dataclasses.replace(SMOKE, out_dir=str(tmp_path / "run"), cache_dir=feature_cache, secure=secure,
                              dropout_prob=0.0, dp_epsilon=4.0, dp_center_devices=5)
    report = run(cfg, quiet=True)
    rounds = 1 + 15 // cfg.clients_per_round             # the center's, then rounds of κ
    assert report["contributed"] == 20 and report["rounds"] == rounds
    z = noise_multiplier_for(4.0, 1 / 20, 1, accounting="rdp" if secure else "pld")
    privacy = report["privacy"]
    assert privacy["noise_multiplier"] == z and privacy["accounting"] == ("rdp" if secure else "pld")
    noisy_sums = rounds - 1 if secure else 1            # central: one noisy sum, at the end
    assert privacy["releases"] == 1 and privacy["epsilon"] <= 4.0 and privacy["noisy_sums"] == noisy_sums
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["config"]["dp_center_devices"] == 5 and results["config"]["feature_clip_norm"] == cfg.dp_clip
    assert results["config"]["dp_min_round_devices"] == 0
    assert results["config"]["dp_release"] == ("round" if secure else "end")
    text = format_report(report)
    assert "privacy                 ε = " in text and "points against the centralized ridge" in text
    assert "W_central" not in text


def assert_wma_recomputes(out, oll: dict, features_of, abs_tol: float) -> None:
    """The global head's and OLL's WMA, recomputed from the saved model, each reporting device's
    shard labels and held-out images, and `features_of(images)`, equal what the job reported."""
    import numpy as np

    from edge_client.data import load_fashion_mnist

    model = np.load(out / "2-fedavg-ft" / "model.npz")
    W, b = model["weight"], model["bias"]
    reported = json.loads((out / "3-oll" / "results.json").read_text())["contributed"]
    assert len(reported) >= 15
    shards, holdouts = np.load(out / "shards.npz"), np.load(out / "holdout.npz")
    images, labels = load_fashion_mnist("train")
    correct = {"global": 0, "oll": 0}
    total = 0
    for dev in reported:
        y = labels[holdouts[dev]]
        logits = features_of(images[holdouts[dev]]) @ W.T + b
        correct["global"] += int((logits.argmax(1) == y).sum())
        local = np.unique(labels[shards[dev]])
        inside = np.isin(y, local)
        masked = np.full_like(logits, -np.inf)
        masked[:, local] = logits[:, local]
        correct["oll"] += int((masked.argmax(1) == y)[inside].sum() + (logits.argmax(1) == y)[~inside].sum())
        total += len(y)
    assert oll["test_samples"] == total
    assert oll["wma"]["global"] == pytest.approx(correct["global"] / total, abs=abs_tol)
    assert oll["wma"]["oll"] == pytest.approx(correct["oll"] / total, abs=abs_tol)
    assert oll["wma"]["oll"] > oll["wma"]["global"]                     # Dirichlet 0.1: OLL must help


def assert_rollout(report: dict, out, extractor) -> None:
    """``--deploy`` (issue 29): the fine-tuned head reaches every emulated device through a seeded
    canary and widening stages, and the same head with permuted classes is rolled back by the
    guard. The canary, the versions per stage and the held-out accuracy the canary reported are
    recomputed here: the cohort from sha256 of the device ids, the accuracy from the saved head
    pruned to each judged device's training labels (the devices personalise: OLL) and its
    held-out images."""
    import hashlib

    import numpy as np

    from edge_client.data import load_fashion_mnist
    from protocols.payloads.deployment import head_npz

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

    images, labels = load_fashion_mnist("train")
    holdouts, shards = np.load(out / "holdout.npz"), np.load(out / "shards.npz")
    W32, b32 = W.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)

    def oll_right(d):              # only the rows of the device's training classes compete
        rows = np.unique(labels[shards[d]])
        pred = rows[(extractor.extract(images[holdouts[d]]) @ W32[rows].T + b32[rows]).argmax(1)]
        return int((pred == labels[holdouts[d]]).sum())

    def pooled(judged):
        return 100 * sum(oll_right(d) for d in judged) / sum(len(holdouts[d]) for d in judged)
    assert good["stages"][0]["reports"] == len(canary) and good["stages"][0]["judged"] == canary
    assert good["stages"][0]["wma_candidate"] == pytest.approx(pooled(canary), abs=1e-9)

    # the broken head may be judged before every canary device reports (the simulation's guard
    # needs one report); what it judged is the fine-tuned head's accuracy on the devices that did
    judged = broken["stages"][0]["judged"]
    assert set(judged) <= set(canary) and len(judged) == broken["stages"][0]["reports"] >= 1
    assert broken["state"] == "rolled_back" and "guard wma_drop<=1.0 failed" in broken["reason"]
    assert broken["stages"][0]["wma_current"] == pytest.approx(pooled(judged), abs=1e-9)
    assert broken["stages"][0]["wma_candidate"] < broken["stages"][0]["wma_current"] - 1
    assert broken["final_versions"] == {sha: len(devices)}           # every canary device went back
    assert json.loads((out / "report.json").read_text())["deployments"]["broken"]["state"] == "rolled_back"
    page = (out / "report.html").read_text()
    assert '<table id="deployments">' in page and "guard wma_drop&lt;=1.0 failed" in page


@pytest.mark.slow
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
def test_fed3r_ft_oll_pipeline_reports_what_the_devices_data_gives(tmp_path, secure, feature_cache):
    """The three-phase pipeline over mosquitto (secure: Fed3R-Sync and secure FedAvg); its first phase
    is ``fedfleet simulate``'s plain Fed3R (drop-outs retried, equal to the centralized ridge); the
    personalised WMA the aggregator reports is recomputed here from the final head and each
    reporting device's held-out images. The plain run then rolls the fine-tuned head out
    (``--deploy``, checked by ``assert_rollout``)."""
    from fedfleet.bundles import make_extractor
    from fedfleet.pipeline import run_pipeline

    cfg = dataclasses.replace(SMOKE, out_dir=str(tmp_path / "run"), cache_dir=feature_cache,
                              ft_rounds=3, fp_epochs=3, secure=secure, deploy=not secure)
    report = run_pipeline(cfg, quiet=True)
    out = tmp_path / "run"
    fed3r, ft, oll = (report["phases"][p] for p in ("fed3r", "fedavg-ft", "oll"))
    assert fed3r["contributions"] == report["devices"] == 20
    assert fed3r["rel_weight_error"] <= (1e-6 if secure else 1e-9)
    assert fed3r["accuracy"] == pytest.approx(fed3r["central_accuracy"], abs=1e-3 if secure else 1e-4)
    assert fed3r["accuracy"] > 0.5                                      # far above chance (0.1)
    phase1 = json.loads((tmp_path / "run" / "1-fed3r" / "results.json").read_text())
    assert phase1["rejections"] == {}
    if not secure:          # provisional classifiers: one per contribution, contributions strictly increasing
        counts = [h["contributions"] for h in phase1["history"]]
        assert counts == sorted(counts) and counts[-1] == 20
    assert ft["rounds"] == 3 and ft["bytes_up"] > 0 and ft["device"]["tasks"] >= ft["contributions"] > 0
    assert oll["bytes_up_per_device"] < ft["bytes_up_per_device"]          # counts only, no tensors
    # independent recomputation of the global head's and OLL's WMA over the devices that reported
    extractor = make_extractor(cfg.backbone, cfg.image_size, cfg.cache_dir, cfg.runtime)
    assert_wma_recomputes(out, oll, extractor.extract, abs_tol=1e-12)
    page = (out / "report.html").read_text()
    assert f"{oll['wma']['oll_fp']:.4f}" in page and "data:image/png;base64," in page
    assert (out / "report.png").stat().st_size > 5000
    if not secure:
        assert_rollout(report, out, extractor)


@pytest.mark.slow
def test_ft_phi_pipeline_fine_tunes_the_backbone_tail_against_the_frozen_fed3r_head(tmp_path, tail_bundle,
                                                                                     feature_cache):
    """--ft-mode phi over mosquitto: devices train the last backbone stage through the ExecuTorch
    tail program; the Fed3R head comes back unchanged, the tail moved, and the reported accuracy
    is the saved model's on the test images, recomputed here with the eager backbone."""
    import numpy as np
    import torch

    from edge_client.models import build_backbone
    from edge_client.models.preprocess import to_model_input
    from fedfleet.pipeline import run_pipeline
    from fedfleet.simulate import _load

    cfg = dataclasses.replace(SMOKE, out_dir=str(tmp_path / "run"), cache_dir=feature_cache,
                              ft_rounds=1, ft_mode="phi", ft_client_lr=0.01, tail_bundle=str(tail_bundle),
                              fp_epochs=2,
                              round_timeout_s=120)       # tail training missed the preset's 30 s under the suite's load
    report = run_pipeline(cfg, quiet=True)
    out = tmp_path / "run"
    assert set(report["phases"]) == {"fed3r", "fedavg-ft", "oll"}
    ft = report["phases"]["fedavg-ft"]
    assert ft["rounds"] == 1 and ft["contributions"] > 0 and ft["device"]["tasks"] >= ft["contributions"]
    fed3r_head, model = np.load(out / "1-fed3r" / "model.npz"), np.load(out / "2-fedavg-ft" / "model.npz")
    np.testing.assert_array_equal(model["weight"], fed3r_head["coef"].astype(np.float32))     # FT(φ): head frozen
    backbone = build_backbone(cfg.backbone)
    pretrained = backbone.features[-1][0].weight.detach().numpy()
    assert not np.allclose(model["tail.stages.0.0.weight"], pretrained)
    backbone.eval()

    def fine_tuned_features(images):
        with torch.no_grad():
            return backbone(torch.from_numpy(to_model_input(images, cfg.image_size, backbone.mean,
                                                            backbone.std))).numpy()

    with torch.no_grad():
        backbone.features[-1][0].weight.copy_(torch.from_numpy(model["tail.stages.0.0.weight"]))
    _, _, _, Xte, yte = _load(cfg)
    accuracy = float(((fine_tuned_features(Xte) @ model["weight"].T + model["bias"]).argmax(1) == yte).mean())
    assert ft["accuracy"] == pytest.approx(accuracy, abs=2 / len(yte))
    assert "FT(φ)" in (out / "report.html").read_text()
    # OLL on the fine-tuned backbone: devices got the tail with the head and personalised on its
    # features (trunk program + eager tail); recomputed with the eager fine-tuned backbone, up to
    # a few argmax flips from the trunk program's float rounding
    oll = report["phases"]["oll"]
    assert oll["bytes_down_per_device"] > model["tail.stages.0.0.weight"].nbytes   # the tail went down
    assert_wma_recomputes(out, oll, fine_tuned_features, abs_tol=3 / oll["test_samples"])


def test_a_tail_bundle_that_is_not_the_runs_is_refused_before_anything_runs(tail_bundle, tmp_path):
    """``simulate --tail-bundle``: a bundle of another tail depth, input size or backbone is one
    clear error naming the export that would fit, before any fleet starts."""
    from fedfleet.pipeline import tail_bundle_manifest

    ok = dataclasses.replace(PRESETS["smoke"], ft_mode="phi", tail_stages=1, tail_bundle=str(tail_bundle))
    assert tail_bundle_manifest(ok) == tail_bundle
    for wrong in (dict(tail_stages=2), dict(image_size=64), dict(backbone="efficientnet_lite0")):
        with pytest.raises(ValueError, match="export one with"):
            tail_bundle_manifest(dataclasses.replace(ok, **wrong))
    from protocols.bundle_manifest import ManifestError

    with pytest.raises(ManifestError, match="no manifest"):
        tail_bundle_manifest(dataclasses.replace(ok, tail_bundle=str(tmp_path / "missing.json")))
