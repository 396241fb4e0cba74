"""Fed3R at the papers' scale: what each device uploads and what the aggregator spends, measured
in one run on synthetic features with the papers' shapes.

Workloads ([P] §V): d = 1280 (MobileNetV2), Google Landmarks (C = 2,028, 1,262 clients) and
iNaturalist Users-160K (C = 1,203, 9,275 clients), client sizes long-tailed (log-normal, median
~20 images, a few with hundreds), each client holding a handful of classes. For every client:

* bytes up: the dense packed triangle + sparse b (float64 as the wire default), the exact factor
  form when it is smaller (float64), the paper's cost model ½d(d+1) + dC̄ fp32 values ([P]
  Table 22, C̄ the client's classes), and one FedAvg(ψ) round (the d×C head + bias, fp32);
* aggregator time per contribution: parse + validate + add, timed on a sample of clients (the
  full fleet's total is extrapolated from that sample, and says so); the final solve.

Prints ratios within this run:  .venv/bin/python bench/fed3r_paper_scale.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob  # noqa: E402
from edge_client.fed3r import Fed3RAccumulator  # noqa: E402
from edge_client.tasks.fed3r_stats import encode_smallest  # noqa: E402
from protocols import messages as M  # noqa: E402
from protocols.envelope import decode, encode  # noqa: E402
from protocols.payloads.fed3r import dense_values, factor_values  # noqa: E402

WORKLOADS = {"landmarks": (2028, 1262), "inaturalist": (1203, 9275)}


def client_sizes(rng, clients: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(mean=3.0, sigma=1.0, size=clients)), 1, 2000).astype(int)


def run(name: str, d: int, classes: int, clients: int, timed: int, rng) -> None:
    p = d + 1
    sizes = client_sizes(rng, clients)
    cbar = np.minimum(sizes, rng.integers(1, 6, clients))           # classes held per client
    dense = np.array([dense_values(p, m) for m in cbar]) * 8
    factor = np.array([min(factor_values(n, p, m), dense_values(p, m)) if n < p else dense_values(p, m)
                       for n, m in zip(sizes, cbar)]) * 8
    paper = np.array([d * (d + 1) // 2 + d * m for m in cbar]) * 4
    fedavg = (d * classes + classes) * 4
    small = sizes <= 64
    print(f"\n{name}: d={d}, C={classes}, {clients} clients, median {int(np.median(sizes))} images "
          f"(max {sizes.max()}), {small.mean():.0%} with <= 64 images")
    print(f"  bytes up per client (mean)   dense {dense.mean() / 1e6:7.2f} MB   factor-or-dense {factor.mean() / 1e6:7.2f} MB"
          f"   paper fp32 {paper.mean() / 1e6:6.2f} MB   FedAvg(psi) one round {fedavg / 1e6:5.2f} MB")
    print(f"  factor / paper fp32 (clients with <= 64 images): max {(factor[small] / 8 / (paper[small] / 4)).max():.3f}"
          f" values   total fleet: dense / factor = {dense.sum() / factor.sum():.1f}x")
    job = Fed3RJob(Fed3RConfig(num_classes=classes, feature_dim=d, lam=1e-2))
    ref = M.TaskRef("fed3r", 1, "0" * 32)
    picked = rng.choice(clients, size=min(timed, clients), replace=False)
    spent = {"factor": [], "dense": []}
    for i in picked:                     # each timed client's statistics in both forms, same data
        n, m = int(min(sizes[i], 300)), int(cbar[i])
        labels = rng.choice(classes, size=m, replace=False)[rng.integers(0, m, n)]
        Z = rng.random(size=(n, d)).astype(np.float32) * 6
        for form, keep in (("factor", True), ("dense", False)):
            acc = Fed3RAccumulator(classes, d, keep_rows=keep)
            acc.update(Z, labels)
            body, tensors = encode_smallest(acc, classes, False, "float64")
            wire = encode(M.result_message(f"dev{i}", ref, "fed3r.stats", body, tensors))
            t0 = time.perf_counter()
            stats = job.parse_result(decode(wire))
            job.strategy.add(stats)
            spent["factor" if body.get("a_format") == "factor" else "dense"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    job.strategy.solve()
    solve = time.perf_counter() - t0
    per = {k: np.mean(v) if v else float("nan") for k, v in spent.items()}
    share = (sizes < p).mean()                          # clients that send the factor form
    total = clients * (share * per["factor"] + (1 - share) * per["dense"])
    print(f"  aggregator per contribution: factor {per['factor'] * 1e3:6.1f} ms, dense {per['dense'] * 1e3:6.1f} ms"
          f" (dense / factor {per['dense'] / per['factor']:.1f}x; {len(picked)} clients timed)")
    print(f"  whole fleet, extrapolated from those: {total:6.1f} s of ingest + {solve:.2f} s solve "
          f"({job.strategy.device}); statistics added here: {job.strategy.n_contributions}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="time 6 clients per workload")
    ap.add_argument("--timed", type=int, default=40, help="clients whose ingest is timed per workload")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for name, (classes, clients) in WORKLOADS.items():
        run(name, 1280, classes, clients, 6 if args.quick else args.timed, rng)


if __name__ == "__main__":
    main()
