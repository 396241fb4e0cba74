"""What judging each device against its fleet without one other device costs (the one-liar fix of
Fed3R's energy screen and LADD's style screen), as ratios measured in one run.

- LADD: ``ladd.typical_spread_without_another`` (columns sorted once, distances in blocks) against
  recomputing each fleet without one style from scratch (np.median, then the distances: what it
  replaced, the same bits, checked here) and against ``nearest_other_distance``, which the screen
  computes anyway.
- Fed3R: ``robust_fed3r.median_without_another`` (one candidate per class group) against one
  class-balanced median of the whole fleet (what the screen computed before), at fleet-100k's size.

    .venv/bin/python bench/screen_leave_one_out.py [--styles 1000] [--style-dims 300] [--devices 100000]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from aggregator.strategies import ladd  # noqa: E402
from aggregator.strategies.robust_fed3r import class_balanced_median, median_without_another  # noqa: E402
from aggregator.strategies.robust_fedavg import typical  # noqa: E402


def recomputed_spreads(X: np.ndarray) -> np.ndarray:
    """Each fleet without one style, from scratch: the typical distance from its median."""
    return np.array([typical(np.linalg.norm(np.delete(X, j, 0) - np.median(np.delete(X, j, 0), axis=0), axis=1))
                     for j in range(len(X))])


def best_of(fn, repeats: int = 3) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--styles", type=int, default=1000)
    ap.add_argument("--style-dims", type=int, default=300)
    ap.add_argument("--devices", type=int, default=100_000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)

    X = rng.standard_normal((args.styles, args.style_dims))
    fast, _ = best_of(lambda: ladd.typical_spread_without_another(X))
    slow, _ = best_of(lambda: recomputed_spreads(X), repeats=1)
    nearest, _ = best_of(lambda: ladd.nearest_other_distance(X))
    medians = ladd.medians_without_each(X)
    same = all(np.array_equal(medians[j], np.median(np.delete(X, j, 0), axis=0)) for j in range(0, len(X), 97))
    print(f"LADD, {args.styles} styles of {args.style_dims}: leave-one-out spread {fast:.2f} s, recomputed "
          f"{slow:.2f} s ({slow / fast:.1f}x), nearest-style distance {nearest:.2f} s "
          f"(spread/nearest {fast / nearest:.2f}x); medians bit-identical on sampled rows: {same}")

    energies = {f"d{i}": float(e) for i, e in enumerate(rng.gamma(4.0, 0.25, args.devices))}
    classes = {d: i % 10 for i, d in enumerate(energies)}
    loo, _ = best_of(lambda: median_without_another(energies, classes))
    whole, _ = best_of(lambda: class_balanced_median(energies, classes))
    print(f"Fed3R, {args.devices} devices in 10 class groups: median without another device, for every device, "
          f"{loo:.3f} s; the fleet's one median {whole:.3f} s ({loo / whole:.1f}x; once per round close)")


if __name__ == "__main__":
    main()
