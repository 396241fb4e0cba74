"""FP(ψ) learning-rate cross-validation on one device: the folds × rates heads trained side by side
(``edge_client.oll.choose_fp_lr`` → ``train_heads_together``) against the loop it replaced (one
``PersonalizedHead.fine_tune`` per (rate, fold), eager torch), on the demo's shapes: a device with
~480 training rows of 1280-d MobileNetV2-like features over 3 local labels, 25 epochs of batch 64,
5 folds, 2 rates. Prints the time ratio and checks that both choose the same rate with the same
cross-validated scores.

    .venv/bin/python bench/fp_cross_validation.py [--rows 480] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")    # as the fleet's device workers run (fedfleet.simulate)
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_client.oll import PersonalizedHead, choose_fp_lr, fp_recipe  # noqa: E402


def fold_by_fold(weight, bias, features, labels, recipe, lrs, folds):
    parts = np.array_split(np.random.default_rng(recipe.seed).permutation(len(labels)), folds)
    scores = {}
    for lr in lrs:
        correct = 0
        for k, held in enumerate(parts):
            fit = np.concatenate([p for j, p in enumerate(parts) if j != k])
            head = PersonalizedHead(weight, bias, labels, fallback="global")
            head.fine_tune(features[fit], labels[fit], replace(recipe, lr=lr))
            correct += head.score(features[held], labels[held]).correct
        scores[lr] = correct / len(labels)
    return max(lrs, key=lambda lr: (scores[lr], -lrs.index(lr))), scores


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=480)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)            # as a device host's compute slot runs it
    rng = np.random.default_rng(0)
    means = rng.normal(0, 1, (10, 1280)).astype(np.float32)
    labels = rng.choice([1, 4, 7], args.rows)
    features = np.clip(means[labels] + rng.normal(0, 1.5, (args.rows, 1280)), 0, 6).astype(np.float32)
    weight, bias = (rng.normal(size=(10, 1280)) * 0.01).astype(np.float32), np.zeros(10, np.float32)
    recipe, lrs = fp_recipe(), [1e-4, 1e-3]
    timings = {"together": [], "fold by fold": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        together = choose_fp_lr(weight, bias, features, labels, recipe, lrs, 5)
        t1 = time.perf_counter()
        alone = fold_by_fold(weight, bias, features, labels, recipe, lrs, 5)
        t2 = time.perf_counter()
        timings["together"].append(t1 - t0)
        timings["fold by fold"].append(t2 - t1)
    best = {k: min(v) for k, v in timings.items()}
    print(f"rows {args.rows}, 5 folds x 2 rates, 25 epochs of 64: together {best['together'] * 1e3:.0f} ms, "
          f"fold by fold (eager torch) {best['fold by fold'] * 1e3:.0f} ms: "
          f"{best['fold by fold'] / best['together']:.1f}x less time")
    print(f"chosen {together[0]:g} vs {alone[0]:g}; scores {together[1]} vs {alone[1]}")
    return 0 if together[0] == alone[0] else 1


if __name__ == "__main__":
    sys.exit(main())
