"""Adding cross-device Fed3R factor uploads to the aggregator's sum: batched GEMM vs one device at a time.

A cross-device device holds a few images, so its A_k = RᵀR has rank ≤ n_k (≈ 5). The aggregator's
``Fed3R`` strategy buffers such rows and adds p/4 of them at once with one GEMM
(``aggregator/strategies/fed3r.py``, ``_add_factor``). This times, in one run and on the same
uploads, that default against flushing after every device (one GEMM per device, what the sum
costs without the batching), prints the ratio and checks both sums against numpy's Σ RᵀR.
Uploads: the canonical factor form of synthetic ReLU-like features (d = 1280, 1 to 12 rows, a
third of the columns dead per device, as MobileNetV2's are), made by the device code.

    .venv/bin/python bench/fed3r_factor_sum.py [--devices 2000] [--d 1280]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from aggregator.strategies.fed3r import Fed3R  # noqa: E402
from edge_client.fed3r import Fed3RAccumulator  # noqa: E402
from protocols.payloads.fed3r import Fed3RStats  # noqa: E402

C = 10


def uploads(devices: int, d: int, seed: int = 0) -> list[Fed3RStats]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(devices):
        n = int(rng.integers(1, 13))
        Z = np.maximum(rng.normal(size=(n, d)), 0) * (rng.random(d) > 0.33)
        y = rng.integers(0, C, n)
        acc = Fed3RAccumulator(C, d, keep_rows=True)
        acc.update(Z, y)
        f = acc.factor()
        out.append(Fed3RStats(n=n, p=d + 1, a_upper=None, class_ids=f.class_ids, b=None, r_factor=f.r_factor,
                              qty=f.qty, factor_columns=np.setdiff1d(np.arange(d + 1), f.zero_columns)))
    return out


def timed_sum(stats: list[Fed3RStats], d: int, flush_rows: int | None) -> tuple[float, np.ndarray]:
    strategy = Fed3R(C, d + 1, device="cpu")
    if flush_rows is not None:
        strategy._flush_rows = flush_rows
    t0 = time.perf_counter()
    for s in stats:
        strategy.add(s)
        if flush_rows is None:
            continue
        strategy._flush()               # one device at a time
    packed = strategy.packed_upper()   # flushes what is left
    return time.perf_counter() - t0, packed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=2000)
    ap.add_argument("--d", type=int, default=1280)
    args = ap.parse_args()
    torch.set_num_threads(1)
    stats = uploads(args.devices, args.d)
    single_s, single = timed_sum(stats, args.d, flush_rows=max(len(s.r_factor) for s in stats))
    batched_s, batched = timed_sum(stats, args.d, flush_rows=None)
    p = args.d + 1
    want = np.zeros((p, p))
    for s in stats:
        full = np.zeros((len(s.r_factor), p))
        full[:, s.factor_columns] = s.r_factor
        want += full.T @ full
    want = want[np.triu_indices(p)]
    err = max(np.abs(x - want).max() / np.abs(want).max() for x in (single, batched))
    print(f"{args.devices} factor uploads, d = {args.d}, one thread")
    print(f"one device at a time: {1e3 * single_s / len(stats):.2f} ms per upload")
    print(f"batched (p/4 rows):   {1e3 * batched_s / len(stats):.2f} ms per upload")
    print(f"ratio: {single_s / batched_s:.1f}x faster batched; both sums within {err:.1e} of numpy's")


if __name__ == "__main__":
    main()
