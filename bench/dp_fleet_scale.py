"""DP Fed3R where it pays: test accuracy at ε ∈ {1, 2, 4, 8} (δ = 1/N) against no DP, for
cross-device fleets of 10,000 and 100,000 devices (issue 25, item 4).

The fleets are the ``fleet-10k`` / ``fleet-100k`` shape: each device draws a long-tailed number of
Fashion-MNIST training images (1 to 50, about 5 on average, label-skewed as Dir(0.1);
``fedfleet.emulation.partition.split_long_tailed``), so images repeat across devices.
Features: MobileNetV2 at 32 px (eager, cached in .cache/features).

What runs is the job's own mechanism, not a re-implementation: every device clips its rows to
F and keeps at most N of them (``edge_client.fed3r``'s rule), the fleet's sum is handed to the
DP strategy (``aggregator.strategies.dp_fed3r.NoisyFed3R``), which adds N(0, (zΔ)²) to every
entry of the packed A and of B and solves on the PSD projection; z is the smallest noise
multiplier dp-accounting allows for one release at (ε, δ) (``noise_multiplier_for``), Δ the
job's sensitivity (``fed3r_sensitivity``). The fleet's sum is formed as Σ_i w_i z_i z_iᵀ over the
distinct images i a device kept (w_i: how many devices kept it) — the same sum in another order,
which the wire path (tested elsewhere to 1e-12) would reach device by device. λ = max(0.01, 2σ√p)
(the noise matrix's spectral norm), as in bench/dp_accuracy.py; nothing is tuned on the test set.

    nice -n 10 .venv/bin/python bench/dp_fleet_scale.py [--fleets 10000 100000] [--cap 10] [--clip 8]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aggregator.compute.privacy import noise_multiplier_for  # noqa: E402
from aggregator.compute.ridge import ClosedFormRidge  # noqa: E402
from aggregator.strategies.dp_fed3r import NoisyFed3R, fed3r_sensitivity  # noqa: E402
from edge_client.data.idx import load_fashion_mnist  # noqa: E402
from edge_client.features import FeatureExtractor  # noqa: E402
from fedfleet.emulation.partition import split_long_tailed  # noqa: E402

EPSILONS = (1.0, 2.0, 4.0, 8.0)
C = 10


def features(split: str) -> tuple[np.ndarray, np.ndarray]:
    extractor = FeatureExtractor.eager("mobilenet_v2", image_size=32, batch_size=256,
                                       cache_dir=REPO / ".cache" / "features", threads=2)
    images, labels = load_fashion_mnist(split)
    return extractor.extract(images).astype(np.float64), labels.astype(np.int64)


def clip_rows(z: np.ndarray, bound: float) -> np.ndarray:
    norms = np.linalg.norm(z, axis=1, keepdims=True)
    return z * np.minimum(1.0, bound / np.maximum(norms, 1e-300))


def fleet_sums(z: np.ndarray, y: np.ndarray, parts: list[np.ndarray], cap: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """(A, B, samples) of the fleet: Σ over devices of their (at most ``cap``) rows, bias appended."""
    kept = [p[:cap] if cap else p for p in parts]       # a device keeps its first N (edge_client's cap)
    weights = np.bincount(np.concatenate(kept), minlength=len(z)).astype(np.float64)
    za = np.hstack([z, np.ones((len(z), 1))])
    a = (za * weights[:, None]).T @ za
    b = (za * weights[:, None]).T @ np.eye(C)[y]
    return a, b, int(weights.sum())


def accuracy(a: np.ndarray, b: np.ndarray, lam: float, test: tuple[np.ndarray, np.ndarray]) -> float:
    model = ClosedFormRidge(lam, True, True, device="cpu").fit_statistics(torch.from_numpy(a), torch.from_numpy(b))
    return model.score(*test)


def dp_accuracy(a: np.ndarray, b: np.ndarray, n: int, eps: float, delta: float, cap: int, clip: float,
                test, seed: int) -> tuple[float, float]:
    z = noise_multiplier_for(eps, delta, 1)
    sigma = z * fed3r_sensitivity(cap, clip, True)
    p = a.shape[0]
    lam = max(0.01, 2 * sigma * math.sqrt(p))
    strategy = NoisyFed3R(C, p, lam, True, True, sigma, rng=np.random.default_rng(seed))
    strategy.pending.add_dense(a[np.triu_indices(p)], b.T, n)
    strategy.release()
    return strategy.solve().score(*test), z


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleets", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--cap", type=int, default=10, help="N: samples a device keeps under DP")
    ap.add_argument("--clip", type=float, default=8.0, help="F: feature row clip norm (about the median norm)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    (ztr, ytr), test = features("train"), features("test")
    print(f"features: train {ztr.shape}, test {test[0].shape} ({time.perf_counter() - t0:.0f}s); "
          f"median row norm {np.median(np.linalg.norm(ztr, axis=1)):.2f}, F = {args.clip}, N = {args.cap}")
    clipped = clip_rows(ztr, args.clip)
    header = f"{'devices':>8} {'samples':>8} {'no DP':>7} {'clip+cap':>8} " + " ".join(f"{'ε=' + str(e):>7}" for e in EPSILONS)
    print(header)
    rows = []
    for n_devices in args.fleets:
        parts = split_long_tailed(ytr, n_devices, alpha=0.1, seed=args.seed)
        a, b, n = fleet_sums(ztr, ytr, parts, None)
        plain = accuracy(a, b, 0.01, test)
        ac, bc, nc = fleet_sums(clipped, ytr, parts, args.cap)
        bounded = accuracy(ac, bc, 0.01, test)
        delta = 1.0 / n_devices
        dp = [dp_accuracy(ac, bc, nc, eps, delta, args.cap, args.clip, test, args.seed) for eps in EPSILONS]
        rows.append((n_devices, n, plain, bounded, dp))
        print(f"{n_devices:>8} {n:>8} {plain:>7.3f} {bounded:>8.3f} " + " ".join(f"{acc:>7.3f}" for acc, _ in dp),
              flush=True)
        print(f"{'':>8} noise multipliers z at δ=1/{n_devices}: " + ", ".join(f"{z:.2f}" for _, z in dp))
    for n_devices, n, plain, bounded, dp in rows:
        print(f"{n_devices} devices: ε=8 keeps {dp[-1][0] / plain:.2f} of the no-DP accuracy, ε=1 keeps "
              f"{dp[0][0] / plain:.2f}")
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
