"""What ``make test``'s ``tests/rewrite_cache.py`` saves each pytest-xdist worker: the CPU of one
``pytest --collect-only`` with PYTHONDONTWRITEBYTECODE set (as every worker starts on CI's machines),
first with no cached assertion rewrites (each worker's lot before), then after the cache was
written, alternated, in one run; and what writing the cache costs once.

    .venv/bin/python bench/collection_cache.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import statistics
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKERS = 4         # make test's -n


def child_cpu(*args: str) -> float:
    """CPU seconds (user + system) of one child process run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    subprocess.run([sys.executable, *args], cwd=REPO, env=env, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def drop_cache() -> None:
    for pyc in (REPO / "tests" / "__pycache__").glob("*-pytest-*.pyc"):
        pyc.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    collect = ("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider")
    cold, warm, write = [], [], []
    for _ in range(args.repeats):
        drop_cache()
        cold.append(child_cpu(*collect))
        write.append(child_cpu("tests/rewrite_cache.py"))
        warm.append(child_cpu(*collect))
    c, w, k = (statistics.median(x) for x in (cold, warm, write))
    print(f"collection CPU-s, no cached rewrites: {c:.2f}  (runs {', '.join(f'{x:.2f}' for x in cold)})")
    print(f"collection CPU-s, cached rewrites:    {w:.2f}  (runs {', '.join(f'{x:.2f}' for x in warm)})")
    print(f"writing the cache once:               {k:.2f}")
    print(f"ratio cached / uncached per worker:   {w / c:.2f}")
    print(f"suite start, {WORKERS} workers: {WORKERS * c:.1f} CPU-s before, {k + WORKERS * w:.1f} after "
          f"({(k + WORKERS * w) / (WORKERS * c):.2f}x)")


if __name__ == "__main__":
    main()
