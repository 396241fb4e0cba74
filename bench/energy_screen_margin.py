"""How far the honest devices of each fleet preset stay below Fed3R's energy screen (issue #26).

The screen (``aggregator/strategies/robust_fed3r.EnergyScreen``) names a device whose energy per
sample e_k (mean squared feature norm) exceeds (ratio + slack/√n_k) × the fleet's class-balanced
median (each device grouped by its dominant class; the largest such median of the fleet without any
one other device, ``EnergyScreen.judged_medians``). This prints, for the demo, fleet-10k and fleet-100k splits of Fashion-MNIST (MobileNetV2 features at
32 px, computed once and cached in .cache/features) and three seeds each, per sample-count bucket:
the devices, the worst honest ratio e_k / median, and the screen's limit at the bucket's smallest n
— honest fleets pass when every worst ratio is below its limit (the "margin" column is limit /
worst). It also prints the per-image tail that sets the slack, and the other side: of up to
``--probe`` devices of each bucket (at random), how many would be screened with features scaled by 2
(4x their energy, the rest of the fleet unchanged).

Usage: nice -n 10 .venv/bin/python bench/energy_screen_margin.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aggregator.jobs.fed3r import Fed3RConfig  # noqa: E402
from edge_client.data.idx import load_fashion_mnist  # noqa: E402
from edge_client.features import FeatureExtractor  # noqa: E402
from fedfleet.emulation.partition import make_split  # noqa: E402
from fedfleet.sim_config import PRESETS  # noqa: E402
from fedfleet.simulate import _load, split_params  # noqa: E402

BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 10**9))


def image_energies() -> np.ndarray:
    extractor = FeatureExtractor.eager("mobilenet_v2", image_size=32, batch_size=256,
                                       cache_dir=REPO / ".cache" / "features", threads=2)
    images, _ = load_fashion_mnist("train")
    Z = extractor.extract(images).astype(np.float64)
    return (Z ** 2).sum(1)


def scaled_by_two_is_screened(screen, energies: np.ndarray, samples: np.ndarray, dominant: dict, device: int) -> bool:
    """Whether ``device`` with its features scaled by 2 (4x its energy) would be screened."""
    scaled = dict(enumerate(energies))
    scaled[device] *= 4
    n = {i: int(k) for i, k in enumerate(samples)}
    return device in screen.outliers(scaled, n, dominant)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--probe", type=int, default=20, help="devices a bucket scaled by 2 (each a re-screen)")
    args = ap.parse_args()
    screen = Fed3RConfig(num_classes=10, feature_dim=1280).energy_screen()   # the job defaults
    energy = image_energies()
    median = np.median(energy)
    print(f"per image: quantiles / median  99%: {np.quantile(energy, .99) / median:.2f}  "
          f"99.9%: {np.quantile(energy, .999) / median:.2f}  max: {energy.max() / median:.2f}  "
          f"(screen limit at n = 1: {screen.limit_ratio(1):.2f})")
    print(f"screen: ratio {screen.ratio} + slack {screen.sample_slack} / sqrt(n)\n")
    print(f"{'preset':<11} {'seed':>4}  {'n':>7} {'devices':>7} {'worst':>6} {'limit':>6} {'margin':>6} "
          f"{'x2 screened':>11}")
    worst_margin, rng = np.inf, np.random.default_rng(0)
    for name in ("demo", "fleet-10k", "fleet-100k"):
        for seed in range(args.seeds):
            cfg = dataclasses.replace(PRESETS[name], seed=seed)
            _, ytr, train_idx, _, _ = _load(cfg)
            parts = [p for p in make_split(cfg.split, ytr[train_idx], cfg.devices, seed, **split_params(cfg)) if len(p)]
            e = np.array([energy[train_idx[p]].mean() for p in parts])
            n = np.array([len(p) for p in parts])
            # the screen's class-balanced median, each device grouped by its dominant class
            dominant = {i: int(np.bincount(ytr[train_idx[p]], minlength=10).argmax()) for i, p in enumerate(parts)}
            judged = screen.judged_medians(dict(enumerate(e)), dominant)
            ratio = e / np.array([judged[i] for i in range(len(e))])
            for lo, hi in BUCKETS:
                inside = (n >= lo) & (n <= hi)
                if not inside.any():
                    continue
                worst, limit = ratio[inside].max(), screen.limit_ratio(lo)
                worst_margin = min(worst_margin, limit / worst)
                probed = rng.permutation(np.flatnonzero(inside))[:args.probe]
                caught = sum(scaled_by_two_is_screened(screen, e, n, dominant, int(i)) for i in probed)
                print(f"{name:<11} {seed:>4}  {f'{lo}-{hi}' if hi < 10**9 else f'{lo}+':>7} {inside.sum():>7} "
                      f"{worst:>6.2f} {limit:>6.2f} {limit / worst:>6.2f} {f'{caught}/{len(probed)}':>11}")
    print(f"\nsmallest margin (limit / worst honest ratio) over every preset, seed and bucket: {worst_margin:.2f}"
          f" ({'no honest device screened' if worst_margin > 1 else 'HONEST DEVICES SCREENED'})")


if __name__ == "__main__":
    main()
