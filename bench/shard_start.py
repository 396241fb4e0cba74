"""How long a local shard takes to start (and to restart after it died): a spawned process, which
imports the job code and torch itself, against a fork of the shards' fork server
(``aggregator/compute/fork_server.py``), which imported them once; and what the server's own start
costs, multiprocessing's (a fresh interpreter importing the job code) against
``start_fork_server_here``'s (a fork of the service, which has imported it already).

Measured: from ``Process.start()`` until the child runs with the shard's modules imported (this
script, which imports them, is what the child loads as its main module under both contexts), the
first start of each context and the starts after it; the ratios are of medians in this one run.
The server's start, each way in a fresh interpreter of its own (a process has one server): the
wall time of the first start and the CPU-seconds of the server process once it has forked it.

    .venv/bin/python bench/shard_start.py [--starts 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import aggregator.shards.local as shard_module  # noqa: E402,F401  (what a shard process imports)
from aggregator.compute.fork_server import fork_server_context, start_fork_server_here  # noqa: E402


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


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_start(how: str) -> dict:
    """In this (fresh) process: the first shard start with its server started ``how``."""
    t0 = time.perf_counter()
    if how == "here":
        start_fork_server_here()
    start_times(fork_server_context("aggregator.shards.local"), 1)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "server_cpu_s": cpu_seconds(mp.forkserver._forkserver._forkserver_pid)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--server", choices=["own", "here"], help=argparse.SUPPRESS)   # a child's measurement
    args = ap.parse_args()
    if args.server:
        print(json.dumps(server_start(args.server)))
        return
    servers = {how: json.loads(subprocess.run([sys.executable, __file__, "--server", how], capture_output=True,
                                              text=True, check=True).stdout)
               for how in ("own", "here")}
    spawned = start_times(mp.get_context("spawn"), args.starts)
    forked = start_times(fork_server_context("aggregator.shards.local"), args.starts)
    print(f"{'':>12} {'first start':>12} {'later (median)':>15}")
    print(f"{'spawn':>12} {spawned[0]:>11.3f}s {statistics.median(spawned[1:]):>14.3f}s")
    print(f"{'fork server':>12} {forked[0]:>11.3f}s {statistics.median(forked[1:]):>14.3f}s")
    print(f"a shard's restart: fork server / spawn = {statistics.median(forked[1:]) / statistics.median(spawned[1:]):.4f}; "
          f"the first start (the server's own imports): {forked[0] / spawned[0]:.2f}")
    own, here = servers["own"], servers["here"]
    print(f"the server's start: multiprocessing's {own['wall_s']:.3f}s, {own['server_cpu_s']:.2f} CPU-s; "
          f"a fork of the service {here['wall_s']:.3f}s, {here['server_cpu_s']:.2f} CPU-s "
          f"(wall {here['wall_s'] / own['wall_s']:.3f}x, CPU {here['server_cpu_s'] / max(own['server_cpu_s'], 0.01):.3f}x)")


if __name__ == "__main__":
    main()
