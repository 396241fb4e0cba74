"""What outvoting wrong unmask shares costs the SecAgg server (protocols/secagg/shamir.py
``reconstruct_verified``), measured in one run.

For a secret shared among n holders with threshold t (the complete graph's t = ⌈2n/3⌉ at the
sizes the "auto" graph runs it, and a SecAgg+ neighbourhood's), the server reconstructs it from
every holder's share and confirms it (here a SHA-256 commitment, as the self-mask seed's):
1. clean: every share right (one interpolation, the usual case);
2. one wrong share among the t the server tries first: Berlekamp–Welch decoding finds and names
   the wrong holder;
3. the round's next secret with that holder known (tried last): one interpolation again.
Printed: milliseconds of each (best of --repeats, CPU time) and their ratios to the clean case,
and for reference the plain ``reconstruct`` (no check, which a wrong share turned into a failed
round).

    .venv/bin/python bench/secagg_reconstruct.py [--sizes 30 100 170] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from protocols.secagg import shamir  # noqa: E402


def best_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[30, 100, 170])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'n':>5} {'t':>5} {'plain ms':>9} {'clean ms':>9} {'one wrong ms':>13} {'next ms':>8} "
          f"{'wrong/clean':>12} {'next/clean':>11}")
    for n in args.sizes:
        t = math.ceil(2 * n / 3)
        secret = rng.bytes(32)
        holders = list(range(1, n + 1))
        shares = dict(zip(holders, (row[0] for row in shamir.split([secret], t, holders))))
        commitment = hashlib.sha256(secret).digest()

        def confirmed(s: bytes) -> bool:
            return hashlib.sha256(s).digest() == commitment

        plain = best_ms(lambda: shamir.reconstruct(shares, t, 32), args.repeats)
        clean = best_ms(lambda: shamir.reconstruct_verified(shares, t, 32, confirmed), args.repeats)
        wrong = dict(shares)
        bad = t // 2                                   # among the first t: the search must leave it out
        wrong[bad] = rng.integers(0, 2**31, len(shares[bad]) // 4, dtype=np.uint32).astype("<u4").tobytes()
        suspects: set[int] = set()

        def outvoted() -> None:
            suspects.clear()
            assert shamir.reconstruct_verified(wrong, t, 32, confirmed, suspects) == secret and suspects == {bad}

        one_wrong = best_ms(outvoted, args.repeats)
        known = {bad}
        after = best_ms(lambda: shamir.reconstruct_verified(wrong, t, 32, confirmed, set(known)), args.repeats)
        print(f"{n:>5} {t:>5} {plain:>9.2f} {clean:>9.2f} {one_wrong:>13.1f} {after:>8.2f} "
              f"{one_wrong / clean:>12.0f} {after / clean:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
