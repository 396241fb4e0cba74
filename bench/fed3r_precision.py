"""(c) Fed3R upload precision: float64 vs float32 on the wire, dense triangle vs exact factor.

The demo's features: a seeded subset of Fashion-MNIST through the pretrained MobileNetV2 at 64 px
(d = 1280; cached under .cache/features), split over K devices. Each device computes its
statistics as a device does (``Fed3RAccumulator``), encodes them in each wire form, and they go
through the wire codec and the aggregator's validation (``parse_stats``) into the Fed3R sums; the
solution is compared with the centralized float64 ridge on all the training features:

* relative weight error ||W - W*|| / ||W*|| of the raw ridge weights (before the column
  normalisation), W* the centralized solution (numpy float64, independent of the Fed3R code);
* test accuracy of the job's model (column-normalised, as Fed3R serves it) next to the
  centralized model's;
* bytes per device on the wire, and how many devices sent the exact factor (the canonical one,
  which every device with fewer samples than features can send and does when it is smaller;
  ``bench/fed3r_factor_bytes.py`` compares it with the factor form before issue #25).

    .venv/bin/python bench/fed3r_precision.py [--train 3000] [--test 1000] [--devices 100] [--lam 0.01]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from aggregator.compute.ridge import ClosedFormRidge, gram_statistics
from aggregator.strategies.fed3r import Fed3R
from edge_client.data import load_fashion_mnist
from edge_client.features import FeatureExtractor
from edge_client.fed3r import Fed3RAccumulator
from protocols.envelope import Envelope, decode, encode
from edge_client.tasks.fed3r_stats import encode_smallest
from protocols.payloads.fed3r import encode_stats, parse_stats

C = 10


def features(n_train: int, n_test: int, seed: int, cache_dir: str):
    Xtr, ytr = load_fashion_mnist("train", None)
    Xte, yte = load_fashion_mnist("test", None)
    rng = np.random.default_rng(seed)
    tr = np.sort(rng.choice(len(ytr), n_train, replace=False))
    te = np.sort(rng.choice(len(yte), n_test, replace=False))
    fx = FeatureExtractor.eager("mobilenet_v2", image_size=64, cache_dir=cache_dir, threads=1)
    return fx.extract(Xtr[tr]), ytr[tr], fx.extract(Xte[te]), yte[te]


def wire_form(Z: np.ndarray, y: np.ndarray, form: str, dtype: str):
    """What a device sends: the dense triangle, or (``factor``) the exact factor where it applies
    and is smaller — the device's own choice (``encode_smallest``), the triangle elsewhere."""
    acc = Fed3RAccumulator(C, Z.shape[1], True, keep_rows=form == "factor")
    acc.update(Z, y)
    if form == "factor":
        return encode_smallest(acc, C, dense=False, dtype=dtype)
    A, ids, b = acc.sparse()
    return encode_stats(A, ids, b, acc.n, C, dtype=dtype)


def federated(parts, Ztr, ytr, form: str, dtype: str, lam: float) -> tuple[Fed3R, float, int]:
    p = Ztr.shape[1] + 1
    server = Fed3R(C, p, lam=lam, device="cpu")
    nbytes = factors = 0
    for idx in parts:
        body, tensors = wire_form(Ztr[idx], ytr[idx], form, dtype)
        factors += body.get("a_format") == "factor"
        payload = encode(Envelope("result", "dev", body, tensors))
        nbytes += len(payload)
        server.add(parse_stats(decode(payload), p, C, positive_definite=server.positive_definite))
    return server, nbytes / len(parts), factors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", type=int, default=3000)
    ap.add_argument("--test", type=int, default=1000)
    ap.add_argument("--devices", type=int, default=100)
    ap.add_argument("--lam", type=float, default=0.01, help="ridge λ (Fed3RConfig's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=".cache/features")
    args = ap.parse_args()
    t0 = time.perf_counter()
    Ztr, ytr, Zte, yte = features(args.train, args.test, args.seed, args.cache_dir)
    print(f"Fashion-MNIST through MobileNetV2 @64px: {len(ytr)} train / {len(yte)} test images, d={Ztr.shape[1]}, "
          f"{args.devices} devices, λ={args.lam} ({time.perf_counter() - t0:.0f} s for features)")
    A, B = gram_statistics(Ztr, ytr, C)                          # centralized, numpy float64
    W_ref = np.linalg.solve(A + args.lam * np.eye(len(A)), B)
    central = ClosedFormRidge(args.lam, device="cpu").fit_statistics(A, B)
    acc_ref = central.score(Zte, yte)
    print(f"cond(A + λI) = {np.linalg.cond(A + args.lam * np.eye(len(A))):.2e}; "
          f"centralized float64 ridge: test accuracy {acc_ref:.4f}")
    parts = np.array_split(np.random.default_rng(args.seed + 1).permutation(len(ytr)), args.devices)
    print(f"{'wire form':<16} {'bytes/device':>12} {'rel. weight error':>18} {'test accuracy':>14} {'Δ accuracy':>11}")
    for form, dtype in (("dense", "float64"), ("dense", "float32"), ("factor", "float64"), ("factor", "float32")):
        server, per_device, factors = federated(parts, Ztr, ytr, form, dtype, args.lam)
        model = server.solve()
        err = np.linalg.norm(model.raw_weights_ - W_ref) / np.linalg.norm(W_ref)
        acc = model.score(Zte, yte)
        print(f"{form + ' ' + dtype:<16} {per_device / 1e6:10.3f} MB {err:18.2e} {acc:14.4f} {acc - acc_ref:+11.4f}"
              f"   ({factors}/{len(parts)} devices sent a factor)")


if __name__ == "__main__":
    main()
