"""Which Fed3R+FT recipe pays on the demo's fleet: a grid over the levers, in-process.

The demo's data and partition (bench/_ft_data.py: Fashion-MNIST 64 px MobileNetV2, Dirichlet
α=0.1 over 100 devices, 20 % of each device held out), the demo's schedule (κ = 10 devices per
round, ``--rounds`` rounds) and the real jobs (bench/_ft_fed.py: ``FedAvgJob`` for FT(ψ) with the
device's ``HeadTrainingTask``; ``TailFedAvgJob`` for FT(φ)/FT(M) with the tail program's eager
computation on cached activations), through the round machine and encoded envelopes, no MQTT.
Two aggregation settings, as the demo runs them: "plain" (the jobs' default bounded-influence
layers) and "secure" (the plain weighted mean, what the secure job computes from a group sum).

The levers: what is fine-tuned (ψ, φ, M) and how many tail stages, the base client LR (devices
get × 0.1 after the Fed3R init), local epochs, server momentum (FedAvgM). Each recipe runs on
every seed (the partition and the sampling follow the seed); the table gives the gain of the
final model over the Fed3R start, in points of test accuracy, mean ± std over seeds.

Usage: .venv/bin/python bench/ft_recipe.py [--rounds 30] [--seeds 0] [--grid psi phi M] [--quick]
Writes runs/bench/ft_recipe.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time

import numpy as np
import torch

from _ft_data import OUT_DIR, load_data
from _ft_fed import AGGREGATION, FineTuning, Recipe, make_setups

TODAY = Recipe("psi", 0.001)          # the demo's recipe before this bench (SimConfig defaults)


def grid(name: str, quick: bool) -> list[Recipe]:
    if name == "psi":
        if quick:
            return [TODAY, Recipe("psi", 0.0003)]
        return [Recipe("psi", lr, e, b) for lr, e, b in itertools.product((0.0003, 0.001, 0.003), (1, 5), (0.0, 0.9))]
    # bench/ft_ceiling.py: with 1/T = 10 and ‖z‖ ≈ 37 even centralized device-sized LRs overshoot
    if quick:
        return [Recipe(name, 0.001, tail_stages=1)]
    return [Recipe(name, lr, e, b, tail_stages=s)
            for s, lr, e, b in itertools.product((1, 2), (0.0001, 0.001), (1, 3), (0.0, 0.9))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--grid", nargs="+", default=["psi", "phi", "M"], choices=["psi", "phi", "M"])
    ap.add_argument("--aggregation", nargs="+", default=list(AGGREGATION), choices=list(AGGREGATION))
    ap.add_argument("--recipe", nargs="+", help="run these recipes only, as JSON objects of Recipe fields")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (more oversubscribe a shared machine)")
    ap.add_argument("--quick", action="store_true", help="1 seed, 5 rounds, 2 ψ recipes and one per tail mode")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.rounds = args.seeds[:1], min(args.rounds, 5)
    torch.set_num_threads(args.threads)
    wall0 = time.perf_counter()
    data = load_data(args.threads)
    ft = FineTuning(data)
    setups = make_setups(data, args.seeds)
    for s in setups:
        print(f"seed {s.seed}: Fed3R {s.fed3r_accuracy:.4f}", flush=True)
    recipes = ([Recipe(**json.loads(r)) for r in args.recipe] if args.recipe
               else [r for name in args.grid for r in grid(name, args.quick)])
    print(f"\nFed3R+FT, {args.rounds} rounds of κ=10: gain of the final model over the Fed3R start (points, "
          f"mean ± std over seeds {args.seeds}), and of the best round", flush=True)
    results = []
    for recipe in recipes:
        for aggregation in args.aggregation:
            t0 = time.perf_counter()
            runs = {s.seed: ft.run(recipe, s, args.rounds, aggregation) for s in setups}
            curves = {seed: r[0] for seed, r in runs.items()}
            gains = [100 * (runs[s.seed][2] - s.fed3r_accuracy) for s in setups]
            # the curve is on the first test images: the best round's gain is against Fed3R there
            best = [100 * (max(curves[s.seed]) - ft.fed3r_on_curve_set(s)) for s in setups]
            results.append({"recipe": dataclasses.asdict(recipe), "aggregation": aggregation, "gain": gains,
                            "best_gain": best, "curves": {str(k): v for k, v in curves.items()}})
            print(f"  {recipe.label():36s} {aggregation:6s}: final {np.mean(gains):+6.2f} ± {np.std(gains):.2f}, "
                  f"best round {np.mean(best):+6.2f}; {time.perf_counter() - t0:.0f}s", flush=True)
    ranked = sorted(results, key=lambda r: -np.mean(r["gain"]))
    print("\nbest recipes by final gain:")
    for r in ranked[:5]:
        print(f"  {Recipe(**r['recipe']).label():36s} {r['aggregation']:6s} {np.mean(r['gain']):+.2f} points")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = {"args": vars(args), "fed3r": {str(s.seed): s.fed3r_accuracy for s in setups}, "results": results,
           "wall_s": time.perf_counter() - wall0}
    (OUT_DIR / "ft_recipe.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT_DIR / 'ft_recipe.json'}; wall {out['wall_s']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
