"""Centralized fine-tuning ceiling of the demo's features: what any federated recipe could add to Fed3R.

Same data as ``fedfleet simulate --config demo`` (Fashion-MNIST, 64 px, pretrained MobileNetV2,
the demo's Dirichlet α=0.1 partition over 100 devices; each device's 20 % held-out split is
not trained on), but all training rows pooled on one machine: no heterogeneity, no sampling,
no communication limit. Every run starts from the Fed3R head (the normalised ridge classifier
on the pooled training rows, exactly what Fed3R computes) and minimises the devices' loss,
CE(logits / T, y) with T = 0.1 (the Fed3R-init rule), by mini-batch SGD (batch 50, momentum
0.9, weight decay 4e-5):

* FT(ψ): the head on the frozen features;
* FT(φ): the backbone's last ``--tail-stages`` stages (BatchNorm frozen, as on device) against the
  frozen Fed3R head;
* FT(M): tail and head together.

For each mode and LR of the grid the epoch (1..E) is picked on the held-out rows (the devices'
held-out splits pooled: a validation set), and the test accuracy at that epoch is reported. The
ceiling is the best mode's test accuracy; the headroom is ceiling − Fed3R.

Usage: .venv/bin/python bench/ft_ceiling.py [--epochs 4] [--tail-stages 1 2] [--modes psi phi M] [--quick]
Writes runs/bench/ft_ceiling.json. Inputs: bench/_ft_data.py (one eager backbone pass, cached).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
from torch.nn import functional as F

from _ft_data import NUM_CLASSES, OUT_DIR, accuracy, demo_partition, load_data, ridge_head, tail_for

TEMPERATURE, BATCH, MOMENTUM, WEIGHT_DECAY = 0.1, 50, 0.9, 4e-5
HEAD_LRS = (1e-6, 1e-5, 1e-4, 1e-3)       # 1/T = 10 and ‖z‖ ≈ 37 (64 px features): the head's gradients are large
TAIL_LRS = (1e-5, 1e-4)


def evaluate(tail, head, inputs: np.ndarray, labels: np.ndarray, batch: int = 4096) -> float:
    with torch.inference_mode():
        correct = 0
        for i in range(0, len(inputs), batch):
            x = torch.from_numpy(inputs[i:i + batch])
            logits = F.linear(tail(x) if tail is not None else x, head.weight, head.bias)
            correct += int((logits.argmax(1).numpy() == labels[i:i + batch]).sum())
    return correct / len(labels)


def fine_tune(start: dict, tail, train: tuple, val: tuple, test: tuple, lr: float, epochs: int,
              train_head: bool, seed: int) -> list[dict]:
    """Per epoch: validation and test accuracy of SGD (momentum, wd) on CE(logits/T) from ``start``."""
    head = torch.nn.Linear(start["weight"].shape[1], NUM_CLASSES)
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(start["weight"]))
        head.bias.copy_(torch.from_numpy(start["bias"]))
    params = (list(head.parameters()) if train_head else []) + (list(tail.parameters()) if tail is not None else [])
    head.requires_grad_(train_head)
    opt = torch.optim.SGD(params, lr=lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    x_all, y_all = torch.from_numpy(train[0]), torch.from_numpy(train[1])
    gen = torch.Generator().manual_seed(seed)
    curve = []
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(y_all), generator=gen)
        for i in range(0, len(order), BATCH):
            idx = order[i:i + BATCH]
            x = x_all[idx]
            logits = F.linear(tail(x) if tail is not None else x, head.weight, head.bias)
            loss = F.cross_entropy(logits / TEMPERATURE, y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if not all(torch.isfinite(p).all() for p in params):
            curve.append({"epoch": epoch, "val": 0.0, "test": 0.0, "diverged": True})
            break
        curve.append({"epoch": epoch, "val": evaluate(tail, head, *val), "test": evaluate(tail, head, *test)})
    return curve


def best_epoch(curve: list[dict]) -> dict:
    return max(curve, key=lambda r: (r["val"], -r["epoch"]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=["psi", "phi", "M"], choices=["psi", "phi", "M"])
    ap.add_argument("--tail-stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tail-lrs", type=float, nargs="+", default=list(TAIL_LRS))
    ap.add_argument("--seed", type=int, default=0, help="the demo's partition seed (SimConfig.seed)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (more oversubscribe a shared machine)")
    ap.add_argument("--quick", action="store_true", help="2 epochs, 1 tail stage, the middle LRs only")
    args = ap.parse_args(argv)
    head_lrs, tail_lrs = HEAD_LRS, tuple(args.tail_lrs)
    if args.quick:
        args.epochs, args.tail_stages = min(args.epochs, 2), args.tail_stages[:1]
        head_lrs, tail_lrs = (1e-6, 1e-5), (1e-5,)
    torch.manual_seed(args.seed)
    wall0 = time.perf_counter()
    data = load_data(args.threads)
    tr, te = data["train"], data["test"]
    parts, held = demo_partition(tr.labels, args.seed)
    train_idx, val_idx = np.sort(np.concatenate(parts)), np.sort(np.concatenate(held))
    start = ridge_head(tr.features[train_idx], tr.labels[train_idx])
    fed3r = accuracy(start["weight"], start["bias"], te.features, te.labels)
    print(f"demo partition (seed {args.seed}): {len(train_idx)} training rows, {len(val_idx)} held-out rows; "
          f"Fed3R head: test {fed3r:.4f}", flush=True)
    rows = []

    def record(mode, stages, lr, curve, s):
        pick = best_epoch(curve)
        rows.append({"mode": mode, "tail_stages": stages, "lr": lr, "curve": curve, "pick": pick, "s": s})
        print(f"  {mode:6s} stages {stages or '-'} lr {lr:<6g}: epoch {pick['epoch']} (val {pick['val']:.4f}) "
              f"test {pick['test']:.4f} ({100 * (pick['test'] - fed3r):+.2f} pts); last epoch test "
              f"{curve[-1]['test']:.4f}; {s:.0f}s", flush=True)

    feats = lambda idx: (tr.features[idx], tr.labels[idx])      # noqa: E731
    for lr in (head_lrs if "psi" in args.modes else ()):
        t0 = time.perf_counter()
        curve = fine_tune(start, None, feats(train_idx), feats(val_idx), (te.features, te.labels), lr,
                          args.epochs, True, args.seed)
        record("FT(ψ)", 0, lr, curve, time.perf_counter() - t0)
    for stages in (args.tail_stages if {"phi", "M"} & set(args.modes) else ()):
        _, lift = tail_for(stages)
        acts_tr, acts_te = lift(tr.acts), lift(te.acts)
        for mode, train_head in (("FT(φ)", False), ("FT(M)", True)):
            if {"FT(φ)": "phi", "FT(M)": "M"}[mode] not in args.modes:
                continue
            for lr in tail_lrs:
                tail, _ = tail_for(stages)
                t0 = time.perf_counter()
                curve = fine_tune(start, tail, (acts_tr[train_idx], tr.labels[train_idx]),
                                  (acts_tr[val_idx], tr.labels[val_idx]), (acts_te, te.labels), lr, args.epochs,
                                  train_head, args.seed)
                record(mode, stages, lr, curve, time.perf_counter() - t0)
    by_mode = {}
    for r in rows:
        key = f"{r['mode']}" + (f" {r['tail_stages']} stage(s)" if r["tail_stages"] else "")
        if key not in by_mode or r["pick"]["val"] > by_mode[key]["pick"]["val"]:
            by_mode[key] = r
    print(f"\ncentralized fine-tuning from the Fed3R head (LR and epoch picked on the held-out rows), "
          f"vs Fed3R {fed3r:.4f}:")
    for key, r in by_mode.items():
        print(f"  {key:22s} lr {r['lr']:<6g} epoch {r['pick']['epoch']}: test {r['pick']['test']:.4f} "
              f"({100 * (r['pick']['test'] - fed3r):+.2f} pts)")
    ceiling = max(by_mode.values(), key=lambda r: r["pick"]["val"])
    print(f"ceiling: {ceiling['mode']} ({ceiling['tail_stages'] or 0} tail stages) {ceiling['pick']['test']:.4f} "
          f"= Fed3R {100 * (ceiling['pick']['test'] - fed3r):+.2f} pts")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "fed3r": fed3r, "rows": rows,
              "best": {k: {"lr": r["lr"], **r["pick"]} for k, r in by_mode.items()},
              "wall_s": time.perf_counter() - wall0}
    (OUT_DIR / "ft_ceiling.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {OUT_DIR / 'ft_ceiling.json'}; wall {report['wall_s']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
