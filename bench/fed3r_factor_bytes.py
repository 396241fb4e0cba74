"""(c) Fed3R upload bytes per device on real MobileNetV2 features: the factor form before and
after the canonical factor (issue #25), in one run.

Fashion-MNIST training images through the pretrained MobileNetV2 at 32 and 64 px (d = 1280, cached
under .cache/features), dealt to a fleet of devices holding a long-tailed number of images (1 to
64, geometric with mean ``--mean-images``), label-skewed. For every device:

* before: the factor form as it was until issue #25, sent only when the thin QR of the device's
  feature matrix is unique (the leading n×n block non-singular), else the dense triangle;
* after: what the device sends now (``encode_smallest``: the canonical factor over the non-zero
  columns, which exists for every device with n < p).

Both are encoded to the wire (``protocols.envelope.encode``: header included) and their sizes
averaged. The "after" uploads also go through the aggregator's validation into the Fed3R sums,
whose ridge solution is compared with the centralized one (numpy, float64, independent of the
Fed3R code); the bound 1.1·8·n·(p + C) of the issue is checked on every factor's tensors.

    .venv/bin/python bench/fed3r_factor_bytes.py [--images 2000] [--mean-images 8] [--lam 0.01]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from aggregator.strategies.fed3r import Fed3R
from edge_client.data import load_fashion_mnist
from edge_client.features import FeatureExtractor
from edge_client.fed3r import Fed3RAccumulator
from edge_client.tasks.fed3r_stats import encode_smallest
from protocols.envelope import Envelope, decode, encode
from protocols.payloads.fed3r import encode_factor, encode_stats, parse_stats

C = 10


def fleet(labels: np.ndarray, mean_images: float, seed: int) -> list[np.ndarray]:
    """Each device's image indices: long-tailed sizes (1..64), neighbouring labels (skewed)."""
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.geometric(1 / mean_images, size=len(labels)), 64)
    sizes = sizes[np.cumsum(sizes) <= len(labels)]
    order = np.argsort(labels + rng.uniform(0, 3, len(labels)), kind="stable")
    return np.split(order, np.cumsum(sizes))[:-1]


def before(acc: Fed3RAccumulator, Z: np.ndarray, y: np.ndarray) -> tuple[dict, dict]:
    """The upload under the rule before issue #25: the QR factor of [Z 1] with a non-negative
    diagonal when its leading block is non-singular (diagonal above 1e-10·max|R|), else dense."""
    A, ids, b = acc.sparse()
    Za = np.hstack([Z, np.ones((len(Z), 1))])
    Q, R = np.linalg.qr(Za)
    signs = np.where(np.diagonal(R) < 0, -1.0, 1.0)
    R, Q = R * signs[:, None], Q * signs[None, :]
    if np.diagonal(R).min() > 1e-10 * max(float(np.abs(R).max()), 1.0):
        onehot = (y[:, None] == ids[None, :]).astype(np.float64)
        return encode_factor(np.triu(R), Q.T @ onehot, ids, len(y), C)
    return encode_stats(A, ids, b, len(y), C)


def measure(Z: np.ndarray, y: np.ndarray, parts: list[np.ndarray], lam: float) -> dict:
    p = Z.shape[1] + 1
    server = Fed3R(C, p, lam=lam, device="cpu")
    out = {"before": [], "after": [], "factor_before": 0, "factor_after": 0, "worst_bound": 0.0}
    for idx in parts:
        acc = Fed3RAccumulator(C, Z.shape[1], True, keep_rows=True)
        acc.update(Z[idx], y[idx])
        for key, (body, tensors) in (("before", before(acc, Z[idx], y[idx])),
                                     ("after", encode_smallest(acc, C, dense=False, dtype="float64"))):
            data = encode(Envelope("result", "dev0000", body, tensors))
            out[key].append(len(data))
            if body.get("a_format") == "factor":
                out["factor_" + key] += 1
                if key == "after":
                    payload = sum(t.nbytes for t in tensors.values())
                    out["worst_bound"] = max(out["worst_bound"], payload / (8 * len(idx) * (p + C)))
            if key == "after":
                server.add(parse_stats(decode(data), p, C, positive_definite=server.positive_definite))
    used = np.concatenate(parts)
    Za = np.hstack([Z[used], np.ones((len(used), 1))])
    W_ref = np.linalg.solve(Za.T @ Za + lam * np.eye(p), Za.T @ np.eye(C)[y[used]])
    out["error"] = float(np.linalg.norm(server.solve().raw_weights_ - W_ref) / np.linalg.norm(W_ref))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--mean-images", type=float, default=8.0, help="mean images per device (capped at 64)")
    ap.add_argument("--lam", type=float, default=0.01, help="ridge λ (Fed3RConfig's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=".cache/features")
    args = ap.parse_args()
    images, labels = load_fashion_mnist("train")
    chosen = np.sort(np.random.default_rng(args.seed).choice(len(labels), args.images, replace=False))
    y = labels[chosen]
    parts = fleet(y, args.mean_images, args.seed + 1)
    sizes = np.array([len(i) for i in parts])
    print(f"Fashion-MNIST through MobileNetV2: {len(sizes)} devices, {sizes.sum()} images, "
          f"{sizes.min()}..{sizes.max()} per device (mean {sizes.mean():.1f}), C = {C}, λ = {args.lam}")
    print(f"{'px':>4} {'factor before':>14} {'factor after':>13} {'bytes/device before':>20} "
          f"{'after':>10} {'before/after':>13} {'max payload / 8n(p+C)':>22} {'rel. weight error':>18}")
    for size in (32, 64):
        t0 = time.perf_counter()
        fx = FeatureExtractor.eager("mobilenet_v2", image_size=size, cache_dir=args.cache_dir, threads=1)
        Z = fx.extract(images[chosen]).astype(np.float64)
        r = measure(Z, y, parts, args.lam)
        b, a = np.mean(r["before"]), np.mean(r["after"])
        print(f"{size:>4} {r['factor_before'] / len(parts):>13.0%} {r['factor_after'] / len(parts):>13.0%} "
              f"{b / 1e6:>17.3f} MB {a / 1e3:>7.1f} KB {b / a:>12.1f}x {r['worst_bound']:>22.3f} "
              f"{r['error']:>18.1e}   ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
