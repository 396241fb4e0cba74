"""SecAgg+'s graph degree for a large group: ``regular_degree`` scans every even degree and sums
P[Binomial(h, keep) < t] for each, term by term below EXACT_HOLDERS holders. Each term's C(h, s) is
now carried from the one before (``protocols/secagg/graph._exact_terms``) where math.comb(h, s) was
computed afresh per term (before stop 82): the same integers times the same floats, so the same
degree, against the same scan with the per-term math.comb — one run, both timed alternately.

    .venv/bin/python bench/secagg_degree.py [--n 2000] [--dropout 0.45] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols.secagg import graph  # noqa: E402


def per_term_comb(holders: int, t: int, keep: float, drop: float):
    """The terms as they were summed before: math.comb(h, s) for each s."""
    return (math.comb(holders, s) * keep ** s * drop ** (holders - s) for s in range(t))


def timed(n: int, dropout: float) -> tuple[float, int]:
    t0 = time.process_time()
    degree = graph.regular_degree(n, dropout)
    return time.process_time() - t0, degree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--dropout", type=float, default=0.45)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    now, before = [], []
    for _ in range(args.repeats):
        seconds, degree = timed(args.n, args.dropout)
        now.append(seconds)
        carried, graph._exact_terms = graph._exact_terms, per_term_comb     # the rule before, for this call
        try:
            seconds_before, degree_before = timed(args.n, args.dropout)
        finally:
            graph._exact_terms = carried
        before.append(seconds_before)
        assert degree == degree_before, (degree, degree_before)
    a, b = statistics.median(now), statistics.median(before)
    print(f"regular_degree(n={args.n}, dropout={args.dropout}) = {degree}: {a:.3f} CPU-s carried, "
          f"{b:.3f} CPU-s with math.comb per term; {a / b:.3f} of it ({b / a:.1f}x faster)")


if __name__ == "__main__":
    main()
