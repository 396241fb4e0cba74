"""Why FedAvg(ψ) from the Fed3R head loses accuracy, and what the head's scale at the init does.

Fed3R's head has unit-norm class columns ([P] §III-D, the class-imbalance correction). On these
features its logits lie close together (the script prints the median top-1 − top-2 margin), so at
T = 0.1 the first label-skewed rounds move every sample's logits the same way and flip many test
predictions. Scaling the normalised head by α at the init (α·W, α·b: the same predictions) widens
the margins the softmax sees by α.

Same data as ``fedfleet simulate --config demo`` (Fashion-MNIST, 64 px, pretrained MobileNetV2, the
demo's Dirichlet α=0.1 partition over 100 devices, each device's 20 % held out). FedAvg(ψ) rounds as
the ``fedavg.head`` task trains them (``edge_client/tasks/ditto_training.local_pass``: the devices'
own numpy step, E = 1, B = 50, wd 4e-5, T = 0.1), κ devices per round seeded, the server's plain
sample-weighted mean (no robust layers). Per (α, device lr): test accuracy after the first round,
after the last, and at the round the pooled held-out rows pick (a validation set), each against
Fed3R's; mean over seeds.

Usage: .venv/bin/python bench/ft_init_scale.py [--rounds 30] [--kappa 10] [--seeds 0 1 2] [--quick]
Inputs: bench/_ft_data.py (one eager backbone pass, cached in .cache/features).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ft_data import accuracy, demo_partition, load_data, ridge_head  # noqa: E402

from edge_client.tasks.ditto_training import local_pass  # noqa: E402
from protocols.payloads.fedavg import LocalTraining  # noqa: E402


def fedavg_curve(head: dict, devices: list[tuple[np.ndarray, np.ndarray]], scale: float, lr: float, rounds: int,
                 kappa: int, seed: int, evaluate) -> list[tuple[float, float]]:
    """(validation, test) accuracy after each round of FedAvg(ψ) from ``scale`` × the head."""
    W, b = head["weight"] * scale, head["bias"] * scale
    rng = np.random.default_rng(seed)
    curve = []
    for r in range(rounds):
        chosen = rng.choice(len(devices), kappa, replace=False)
        outs = [local_pass(W, b, *devices[i], LocalTraining(lr=lr, seed=seed * 10_000 + r)) for i in chosen]
        n = np.array([len(devices[i][1]) for i in chosen], dtype=np.float64)
        n /= n.sum()
        W = sum(w * o["weight"] for w, o in zip(n, outs)).astype(np.float32)
        b = sum(w * o["bias"] for w, o in zip(n, outs)).astype(np.float32)
        curve.append(evaluate(W, b))
    return curve


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--kappa", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--scales", type=float, nargs="+", default=[1, 3, 10])
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    ap.add_argument("--quick", action="store_true", help="10 rounds, one seed")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.seeds = 10, args.seeds[:1]
    data = load_data()
    tr, te = data["train"], data["test"]
    rows = {}
    for seed in args.seeds:
        parts, holdouts = demo_partition(tr.labels, seed)
        train_idx, val_idx = np.concatenate(parts), np.concatenate(holdouts)
        head = ridge_head(tr.features[train_idx], tr.labels[train_idx])
        fed3r = accuracy(head["weight"], head["bias"], te.features, te.labels)
        logits = np.sort(te.features @ head["weight"].T + head["bias"], axis=1)
        print(f"seed {seed}: Fed3R test {fed3r:.4f}; median top-1 - top-2 logit margin "
              f"{np.median(logits[:, -1] - logits[:, -2]):.4f} (x1/T = {np.median(logits[:, -1] - logits[:, -2]) / 0.1:.3f})",
              flush=True)
        devices = [(tr.features[p].astype(np.float32), tr.labels[p]) for p in parts if len(p)]

        def evaluate(W, b):
            return (accuracy(W, b, tr.features[val_idx], tr.labels[val_idx]), accuracy(W, b, te.features, te.labels))
        for scale in args.scales:
            for lr in args.lrs:
                curve = fedavg_curve(head, devices, scale, lr, args.rounds, args.kappa, seed, evaluate)
                picked = max(range(len(curve)), key=lambda i: curve[i][0])
                rows.setdefault((scale, lr), []).append(
                    (curve[0][1] - fed3r, curve[-1][1] - fed3r, curve[picked][1] - fed3r))
    print(f"\nFedAvg(ψ) from α × the Fed3R head, {args.rounds} rounds of κ={args.kappa}, mean over seeds "
          f"{args.seeds}: test accuracy minus Fed3R's, points")
    print(f"{'α':>5} {'device lr':>10} {'round 1':>9} {'last':>9} {'val-picked':>11}")
    for (scale, lr), vals in rows.items():
        first, last, picked = (100 * np.mean([v[i] for v in vals]) for i in range(3))
        print(f"{scale:>5g} {lr:>10g} {first:>+9.2f} {last:>+9.2f} {picked:>+11.2f}")


if __name__ == "__main__":
    main()
