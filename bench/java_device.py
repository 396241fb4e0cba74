"""The Java device library's per-task cost against the Python device's, measured in one run on
the same data: Fed3R statistics of n feature vectors (d = 1280, MobileNetV2's features) and one
SecAgg mask expansion of a Fed3R-Sync vector's length (AES-128-CTR keystream added mod 2^64).

    python bench/java_device.py [--n 200] [--dim 1280] [--repeats 5]

Prints best-of-repeats milliseconds of CPU time of the working thread (stable on a loaded machine,
where wall time is not) for each side and the Java / Python ratio. Needs a JDK and Debian's jars
(make setup); single-threaded on both sides (numpy with OMP/OPENBLAS_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import java_build  # noqa: E402
from edge_client.fed3r import Fed3RAccumulator  # noqa: E402
from protocols.payloads.secagg import sync_vector_length  # noqa: E402
from protocols.secagg.crypto import apply_masks  # noqa: E402


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append((time.thread_time() - t0) * 1e3)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--dim", type=int, default=1280)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if java_build.missing():
        sys.exit(java_build.missing())
    rng = np.random.default_rng(0)
    Z = np.clip(rng.normal(1.0, 1.0, (args.n, args.dim)), 0, 6).astype(np.float32)   # ReLU6-like features
    y = rng.integers(0, args.classes, args.n)
    words = sync_vector_length(args.dim + 1, args.classes)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.feat"
        path.write_bytes(struct.pack("<ii", *Z.shape) + Z.astype("<f4").tobytes() + y.astype("<i4").tobytes())
        cp = java_build.build(Path(tmp) / "classes", ROOT / "bench" / "java")
        out = subprocess.run(["java", "-XX:ActiveProcessorCount=1", "-cp", cp, "Fed3RTiming", str(path),
                              str(args.classes), str(words), str(args.repeats)],
                             capture_output=True, text=True, check=True).stdout
    java = dict(line.split() for line in out.splitlines())

    def python_stats():
        acc = Fed3RAccumulator(args.classes, args.dim)
        acc.update(Z, y)
        acc.sparse()

    target = np.zeros(words, np.uint64)
    py = {"STATS_MS": best_ms(python_stats, args.repeats),
          "MASK_MS": best_ms(lambda: apply_masks(target, [(bytes(32), 1)]), args.repeats)}
    print(f"n={args.n} d={args.dim} C={args.classes}; Fed3R-Sync vector = {words} words")
    for key, what in (("STATS_MS", "Fed3R statistics"), ("MASK_MS", "one mask expansion")):
        j, p = float(java[key]), py[key]
        print(f"{what:22s} Java {j:8.1f} ms   Python/numpy {p:8.1f} ms   Java/Python {j / p:5.2f}x")


if __name__ == "__main__":
    main()
