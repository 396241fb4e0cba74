"""How long a local shard takes to start (and to restart after it died): a spawned process, which
imports the job code and torch itself, against a fork of the shards' fork server
(``aggregator/compute/fork_server.py``), which imported them once.

Measured: from ``Process.start()`` until the child runs with the shard's modules imported (this
script, which imports them, is what the child loads as its main module under both contexts), the
first start of each context and the starts after it; the ratios are of medians in this one run.

    .venv/bin/python bench/shard_start.py [--starts 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import aggregator.shards.local as shard_module  # noqa: E402,F401  (what a shard process imports)
from aggregator.compute.fork_server import fork_server_context  # noqa: E402


def running(queue) -> None:
    queue.put(time.perf_counter())


def start_times(ctx, starts: int) -> list[float]:
    """Seconds from start() until the child runs, for ``starts`` children one after another."""
    times = []
    for _ in range(starts):
        queue = ctx.Queue()
        t0 = time.perf_counter()
        proc = ctx.Process(target=running, args=(queue,), daemon=True)
        proc.start()
        times.append(queue.get(timeout=120) - t0)
        proc.join()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--starts", type=int, default=5)
    args = ap.parse_args()
    spawned = start_times(mp.get_context("spawn"), args.starts)
    forked = start_times(fork_server_context("aggregator.shards.local"), args.starts)
    print(f"{'':>12} {'first start':>12} {'later (median)':>15}")
    print(f"{'spawn':>12} {spawned[0]:>11.3f}s {statistics.median(spawned[1:]):>14.3f}s")
    print(f"{'fork server':>12} {forked[0]:>11.3f}s {statistics.median(forked[1:]):>14.3f}s")
    print(f"a shard's restart: fork server / spawn = {statistics.median(forked[1:]) / statistics.median(spawned[1:]):.4f}; "
          f"the first start (the server's own imports): {forked[0] / spawned[0]:.2f}")


if __name__ == "__main__":
    main()
