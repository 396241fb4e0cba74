"""Durable write of one large accepted result: the store's payload file vs a SQLite BLOB (schema 1).

The store (``aggregator.storage.store.Store``, schema 2) writes a contribution's payload to its own file,
fsynced before the row's commit (two flushes per contribution: the file, then the WAL). Schema 1
inserted the payload into the table (WAL, synchronous=FULL, 32 KiB pages: one flush per commit,
but every payload written twice, to the WAL and again by the checkpoints, which stall one commit
in a few). The two alternate, write by write, in one process, so both see the same disk and CPU;
also timed: reading every payload back (the final re-sum of a Fed3R job reads them all).

Then one payload file written around the page cache (``O_DIRECT``, what the store does for a
large payload) vs through it (buffered), alternating, each fsynced: wall time and this process's
CPU time (user + kernel) per file.

    .venv/bin/python bench/store_write.py [--mb 6.6] [--writes 60]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aggregator.storage.blob_files import BlobFiles  # noqa: E402
from aggregator.storage.store import Store  # noqa: E402


class BlobTable:
    """Schema 1's contributions table, payload inline, with the store's pragmas."""

    def __init__(self, path: Path):
        self.db = sqlite3.connect(path, isolation_level=None)
        for pragma in ("page_size=32768", "journal_mode=WAL", "synchronous=FULL"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.execute("CREATE TABLE contributions (seq INTEGER PRIMARY KEY AUTOINCREMENT, device TEXT NOT NULL, "
                        "payload BLOB NOT NULL)")

    def add_contribution(self, device: str, payload: bytes) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        self.db.execute("INSERT INTO contributions (device, payload) VALUES (?, ?)", (device, payload))
        self.db.execute("COMMIT")

    def read_all(self) -> int:
        return sum(len(r[0]) for r in self.db.execute("SELECT payload FROM contributions ORDER BY device"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=6.6, help="payload size (6.6 MB: Fed3R statistics at d=1280)")
    ap.add_argument("--writes", type=int, default=60)
    args = ap.parse_args()
    payload = os.urandom(int(args.mb * 1e6))
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "state.db")
        store.create_job("bench", "fed3r", {})
        store.open_round("bench", 1, [], {}, {}, time.time() + 3600)
        table = BlobTable(Path(tmp) / "v1.db")
        writers = {"payload file (store)": lambda i: store.add_contribution("bench", 1, f"d{i:04d}", f"m{i}", payload),
                   "SQLite BLOB (schema 1)": lambda i: table.add_contribution(f"d{i:04d}", payload)}
        times: dict[str, list[float]] = {name: [] for name in writers}
        for i in range(args.writes):
            for name in (list(writers) if i % 2 else list(writers)[::-1]):
                t0 = time.perf_counter()
                writers[name](i)
                times[name].append(time.perf_counter() - t0)
        readers = {"payload file (store)": lambda: sum(len(c.payload) for c in store.contributions("bench")),
                   "SQLite BLOB (schema 1)": table.read_all}
        print(f"{args.writes} writes of {len(payload) / 1e6:.1f} MB each, alternating (per contribution):")
        means = {}
        for name, t in times.items():
            t0 = time.perf_counter()
            assert readers[name]() == args.writes * len(payload)
            read = (time.perf_counter() - t0) / args.writes
            means[name] = statistics.mean(t)
            print(f"  {name:24s} write mean {means[name] * 1e3:6.1f} ms  median {statistics.median(t) * 1e3:6.1f} ms  "
                  f"p90 {sorted(t)[int(0.9 * len(t))] * 1e3:6.1f} ms  max {max(t) * 1e3:6.1f} ms  read {read * 1e3:5.1f} ms")
        file_mean, blob_mean = means.values()
        print(f"  write time, payload file / SQLite BLOB: {file_mean / blob_mean:.2f}")
        direct_vs_buffered(Path(tmp) / "files", payload, args.writes)


def direct_vs_buffered(directory: Path, payload: bytes, count: int) -> None:
    blobs = BlobFiles(directory, durable=True)
    if blobs.direct:
        blobs.write(1, payload)                 # a file system that refuses O_DIRECT turns it off here
    if not blobs.direct:
        print("this platform or file system has no O_DIRECT: buffered writes only")
        return
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for i in range(count):
        for direct in ((True, False) if i % 2 else (False, True)):
            blobs.direct = direct
            t0, c0 = time.perf_counter(), os.times()
            blobs.write(2 + 2 * i + direct, payload)
            c1 = os.times()
            wall[direct].append(time.perf_counter() - t0)
            cpu[direct].append(c1.user + c1.system - c0.user - c0.system)
    print(f"{count} payload files each way, alternating (per file, fsync included):")
    for direct, name in ((True, "O_DIRECT"), (False, "buffered")):
        print(f"  {name:24s} wall mean {statistics.mean(wall[direct]) * 1e3:6.1f} ms  "
              f"CPU mean {statistics.mean(cpu[direct]) * 1e3:6.1f} ms")
    print(f"  O_DIRECT / buffered: wall {statistics.mean(wall[True]) / statistics.mean(wall[False]):.2f}, "
          f"CPU {statistics.mean(cpu[True]) / max(statistics.mean(cpu[False]), 1e-9):.2f}")


if __name__ == "__main__":
    main()
