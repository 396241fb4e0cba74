"""(b) Fed3R solve time vs feature dimension (d for plain Fed3R, D for Fed3R-RF).

For each p it times: folding one device's packed triangle into the sums, and the Cholesky solve
(float64) on the CPU, and on CUDA when torch sees a GPU. Prints seconds and ratios to the
smallest p, and GPU speed-ups, all from one run.

    .venv/bin/python bench/fed3r_solve.py [--dims 1280 2048 4096 8192 16384] [--classes 10]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from aggregator.strategies.fed3r import Fed3R
from protocols.payloads.fed3r import Fed3RStats


def time_solve(p: int, C: int, device: str, reps: int = 1) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    n = 2 * p
    Z = rng.normal(size=(n, p - 1)).astype(np.float64) / np.sqrt(p)
    Za = np.hstack([Z, np.ones((n, 1))])
    A = Za.T @ Za
    packed = A[np.triu_indices(p)]
    ids = np.arange(C)
    b = rng.normal(size=(C, p))
    s = Fed3R(C, p, device=device)
    stats = Fed3RStats(n, p, packed, ids, b)
    s.add(stats)  # warm-up (index caches, CUDA context)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        s.add(stats)
    if device == "cuda":
        torch.cuda.synchronize()
    t_add = (time.perf_counter() - t0) / reps
    s.solve()
    t0 = time.perf_counter()
    for _ in range(reps):
        s.solve()
    if device == "cuda":
        torch.cuda.synchronize()
    return t_add, (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="+", default=[1281, 2049, 4097, 8193])
    ap.add_argument("--classes", type=int, default=10)
    args = ap.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, devices={devices}"
          + (f" ({torch.cuda.get_device_name()})" if "cuda" in devices else ""))
    base = {}
    print(f"{'p':>7} {'device':>6} {'add (s)':>9} {'solve (s)':>10} {'solve / p0':>10} {'cpu/gpu':>8}")
    for p in args.dims:
        row = {}
        for dev in devices:
            t_add, t_solve = time_solve(p, args.classes, dev)
            row[dev] = t_solve
            base.setdefault(dev, t_solve)
            speed = f"{row['cpu'] / t_solve:8.1f}" if dev == "cuda" else ""
            print(f"{p:>7} {dev:>6} {t_add:9.4f} {t_solve:10.4f} {t_solve / base[dev]:10.1f} {speed}")


if __name__ == "__main__":
    main()
