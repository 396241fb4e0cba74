"""Personalised accuracy (WMA) of the global head, OLL, FP(ψ) and OLL+FP(ψ) on Fashion-MNIST.

Each of 100 devices (2 classes/device, or Dirichlet 0.1; seeds as given) keeps 25% of its
samples as a local held-out split. The federation trains on the remaining 75% only:

* global heads: Fed3R (normalised ridge head, bias included) and Fed3R+FT(ψ) (FedAvg(ψ)
  from the Fed3R head, ``--ft-rounds`` rounds, client LR 0.01 × 0.1, no server momentum:
  the setting that degraded the Fed3R head least in bench/fed3r_vs_fedavg.py);
* per device, on its held-out split: the global head; OLL (global head pruned to the local
  training labels, prediction among those only); FP(ψ) without OLL (the full head fine-tuned
  locally); OLL+FP(ψ) (the pruned head fine-tuned locally). FP = 25 epochs, batch 64,
  T = 0.1, LR by the spec's rule (base 0.1 × 0.1 for a Fed3R-initialised head, × 0.1 again
  with OLL; without OLL only the first factor).

WMA = Σ_k correct_k / Σ_k n_k (``aggregator.compute.evaluation.weighted_mean_accuracy``). Held-out
labels that a device never saw in training (possible under Dirichlet splits) break OLL's
closed-set assumption; they are scored with the global head (OLL ``fallback="global"``) and
their number is printed.

Runs the real Fed3R/FedAvg jobs and device task handlers in-process (no MQTT, see
bench/fed3r_vs_fedavg.py, whose fleet driver it reuses) and edge_client.oll for OLL/FP.
Usage: .venv/bin/python bench/personalization.py [--seeds 0 1 2] [--ft-rounds 100] [--quick]
Writes runs/bench/personalization.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from fed3r_vs_fedavg import (IMAGE_SIZE, OUT_DIR, SPLITS, Fleet, load_features, mean_std,  # noqa: E402
                             run_fed3r, run_fedavg)

from aggregator.compute.evaluation import head_logits, weighted_mean_accuracy  # noqa: E402
from edge_client.oll import PersonalizedHead, choose_fp_lr, fp_recipe  # noqa: E402
from edge_client.tasks.head_training import train_head  # noqa: E402
from fedfleet.emulation.partition import make_split, train_holdout_split  # noqa: E402
from fedfleet.plots import plot_lines  # noqa: E402

HOLDOUT = 0.25
FOLDS = 5                 # cross-validation folds for the device's choice of FP learning rate
FT_BASE_LR = 0.01
METHODS = ("global", "OLL", "FP(ψ)", "OLL+FP(ψ)", "OLL+FP(ψ) lr/10", "OLL+FP(ψ) val-LR")


def personalise(weight, bias, device_data, seed, fed3r_init=True):
    """Per-device (correct, total) for each method, plus the out-of-set held-out count.

    FP(ψ) uses the spec's LR rule; "lr/10" repeats OLL+FP(ψ) with a 10× smaller LR (the rule
    is ambiguous, spec §7.8, and these 32 px features are small: mean norm ≈ 7). "val-LR" is
    what the product's personalization job does (``aggregator.jobs.personalize``): each device
    picks between a tenth of the rule's LR and the rule's LR (ties to the former) by 5-fold
    cross-validation on its training split (``edge_client.oll.choose_fp_lr``), then fine-tunes
    on all of its training split."""
    scores = {m: ([], []) for m in METHODS}
    outside = 0
    for k, (ftr, ytr, fho, yho) in enumerate(device_data):
        def add(method, correct):
            scores[method][0].append(int(correct))
            scores[method][1].append(len(yho))

        add("global", (head_logits(weight, bias, fho).argmax(axis=1) == yho).sum())
        oll = PersonalizedHead(weight, bias, ytr, fallback="global")
        s = oll.score(fho, yho)
        outside += s.fallback
        add("OLL", s.correct)
        no_oll = replace(fp_recipe(seed=seed + k), lr=0.1 * (0.1 if fed3r_init else 1.0))   # no OLL factor
        full = train_head(weight, bias, ftr, ytr, no_oll)
        add("FP(ψ)", (head_logits(full.weight, full.bias, fho).argmax(axis=1) == yho).sum())
        rule = fp_recipe(base_lr=0.1, fed3r_init=fed3r_init, seed=seed + k)
        chosen, _ = choose_fp_lr(weight, bias, ftr, ytr, rule, [rule.lr / 10, rule.lr], FOLDS)
        for name, recipe in (("OLL+FP(ψ)", rule), ("OLL+FP(ψ) lr/10", replace(rule, lr=rule.lr / 10)),
                             ("OLL+FP(ψ) val-LR", replace(rule, lr=chosen))):
            tuned = PersonalizedHead(weight, bias, ytr, fallback="global")
            tuned.fine_tune(ftr, ytr, recipe)
            add(name, tuned.score(fho, yho).correct)
    return scores, outside


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=1, help="torch threads for local training")
    ap.add_argument("--devices", type=int, default=100)
    ap.add_argument("--kappa", type=int, default=10)
    ap.add_argument("--ft-rounds", type=int, default=100)
    ap.add_argument("--image-size", type=int, default=IMAGE_SIZE,
                    help="backbone input size (the demo's fleet runs at 64 px)")
    ap.add_argument("--quick", action="store_true", help="1 seed, 20 FT rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.ft_rounds = args.seeds[:1], min(args.ft_rounds, 20)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    data, _ = load_features(args.image_size)
    torch.set_num_threads(args.threads)   # tiny per-step work: more threads only add contention
    images, labels, feats = data["train"]
    eval_set = data["test"][2], data["test"][1]
    report, cdf_lines = {}, {}
    for split_name, (kind, params) in SPLITS.items():
        wma = {}          # (head, method) -> [per seed]
        outside_counts, holdout_sizes = [], []
        for seed in args.seeds:
            t0 = time.perf_counter()
            parts = make_split(kind, labels, args.devices, seed, **params)
            train_parts, hold_parts = zip(*(train_holdout_split(p, HOLDOUT, seed * 1000 + k)
                                            for k, p in enumerate(parts)))
            fleet = Fleet.build(data, list(train_parts))
            fed3r_job, _ = run_fed3r(fleet, eval_set, seed, args.kappa, 0.0)
            model = fed3r_job.model()
            ft_job, ft_curve = run_fedavg(fleet, eval_set, seed, args.kappa, args.ft_rounds, FT_BASE_LR, 0.0, 0.0, model)
            heads = {"Fed3R": (model.coef_.astype(np.float32), model.intercept_.astype(np.float32)),
                     f"Fed3R+FT(ψ) {args.ft_rounds}r": (ft_job.params["weight"], ft_job.params["bias"])}
            device_data = [(feats[t], labels[t], feats[h], labels[h]) for t, h in zip(train_parts, hold_parts)]
            holdout_sizes.append(sum(len(h) for h in hold_parts))
            for head_name, (W, b) in heads.items():
                scores, outside = personalise(W, b, device_data, seed)
                for m in METHODS:
                    wma.setdefault((head_name, m), []).append(weighted_mean_accuracy(*scores[m]))
                    if seed == args.seeds[0] and head_name == "Fed3R":
                        acc = np.sort(np.divide(*scores[m]))
                        cdf_lines[f"{split_name}: {m}"] = (acc, np.arange(1, len(acc) + 1) / len(acc))
            outside_counts.append(outside)
            print(f"[{split_name}] seed {seed}: Fed3R test acc {fed3r_job.evaluate(*eval_set)['accuracy']:.4f}, "
                  f"Fed3R+FT(ψ) test acc {ft_curve.accuracy[-1]:.4f}, {time.perf_counter() - t0:.0f}s", flush=True)
        print(f"\n=== {split_name}: personalised WMA on local held-out splits ({len(args.seeds)} seeds; "
              f"{mean_std(outside_counts)} of {mean_std(holdout_sizes)} held-out samples per seed have a label "
              "unseen in local training, scored by the global head) ===")
        rows = {}
        for head_name in dict.fromkeys(h for h, _ in wma):
            vals = {m: wma[(head_name, m)] for m in METHODS}
            rows[head_name] = vals
            print(f"  {head_name:22s} " + "  ".join(f"{m} {mean_std(vals[m])}" for m in METHODS))
            oll_vs_global = np.mean(np.array(vals["OLL"]) - np.array(vals["global"]))
            fp_vs_oll = np.mean(np.array(vals["OLL+FP(ψ)"]) - np.array(vals["OLL"]))
            fp10_vs_oll = np.mean(np.array(vals["OLL+FP(ψ) lr/10"]) - np.array(vals["OLL"]))
            val_vs_oll = np.mean(np.array(vals["OLL+FP(ψ) val-LR"]) - np.array(vals["OLL"]))
            print(f"  {'':22s} OLL − global = {100 * oll_vs_global:+.2f} pts "
                  f"({sum(a > b for a, b in zip(vals['OLL'], vals['global']))}/{len(args.seeds)} seeds); "
                  f"OLL+FP − OLL = {100 * fp_vs_oll:+.2f} pts "
                  f"({sum(a > b for a, b in zip(vals['OLL+FP(ψ)'], vals['OLL']))}/{len(args.seeds)} seeds), "
                  f"with lr/10 {100 * fp10_vs_oll:+.2f} pts "
                  f"({sum(a > b for a, b in zip(vals['OLL+FP(ψ) lr/10'], vals['OLL']))}/{len(args.seeds)} seeds), "
                  f"with the LR chosen on-device {100 * val_vs_oll:+.2f} pts "
                  f"({sum(a > b for a, b in zip(vals['OLL+FP(ψ) val-LR'], vals['OLL']))}/{len(args.seeds)} seeds); "
                  f"error ratio (1−OLL+FP)/(1−global) = "
                  f"{np.mean([(1 - a) / (1 - b) for a, b in zip(vals['OLL+FP(ψ)'], vals['global'])]):.3f}")
        report[split_name] = {"wma": rows, "outside": outside_counts, "holdout": holdout_sizes}
    stem = "personalization" if args.image_size == IMAGE_SIZE else f"personalization-{args.image_size}px"
    engine = plot_lines(OUT_DIR / f"{stem}.png",
                        [{"title": f"{s}: per-device accuracy CDF (Fed3R head, seed {args.seeds[0]})",
                          "xlabel": "device accuracy", "ylabel": "fraction of devices",
                          "lines": {k.split(": ")[1]: v for k, v in cdf_lines.items() if k.startswith(s)}}
                         for s in SPLITS])
    (OUT_DIR / f"{stem}.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {OUT_DIR / stem}.png ({engine}) and {stem}.json")


if __name__ == "__main__":
    sys.exit(main())
