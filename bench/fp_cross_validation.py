"""FP(ψ) learning-rate cross-validation on one device: the folds × rates heads trained side by side
(``edge_client.tasks.numpy_head.train_heads_together``, what ``edge_client.oll.choose_fp_lr`` runs)
against training them one by one as before (``train_head``: eager torch, one SGD loop per head),
on the demo's shapes: ~480 training rows of 1280-d MobileNetV2-like features over 3 local labels,
25 epochs of batch 64, 5 folds, 2 rates. Prints the time ratio and the largest weight difference.

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

from edge_client.oll import fp_recipe  # noqa: E402
from edge_client.tasks.head_training import train_head  # noqa: E402
from edge_client.tasks.numpy_head import train_heads_together  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=480)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)            # as a device host's compute slot runs it
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, args.rows)               # local indices of the pruned 3-class head
    features = np.clip(rng.normal(0, 1, (3, 1280))[labels] + rng.normal(0, 1.5, (args.rows, 1280)), 0, 6)
    features = features.astype(np.float32)
    weight, bias = (rng.normal(size=(3, 1280)) * 0.01).astype(np.float32), np.zeros(3, np.float32)
    parts = np.array_split(rng.permutation(args.rows), 5)
    fits = [np.concatenate(parts[:k] + parts[k + 1:]) for k in range(5)]
    recipe, lrs = fp_recipe(), [1e-4, 1e-3]
    best = {"together": np.inf, "one by one": np.inf}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        together, _ = train_heads_together(weight, bias, features, labels, fits, lrs, recipe)
        t1 = time.perf_counter()
        alone = np.array([[train_head(weight, bias, features[rows], labels[rows], replace(recipe, lr=lr)).weight
                           for lr in lrs] for rows in fits])
        t2 = time.perf_counter()
        best["together"], best["one by one"] = min(best["together"], t1 - t0), min(best["one by one"], t2 - t1)
    print(f"{args.rows} rows, 5 folds x 2 rates, 25 epochs of 64: together {best['together'] * 1e3:.0f} ms, "
          f"one by one (eager torch) {best['one by one'] * 1e3:.0f} ms: "
          f"{best['one by one'] / best['together']:.1f}x less time; "
          f"largest weight difference {np.abs(together - alone).max():.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
