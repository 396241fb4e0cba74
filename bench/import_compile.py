"""What `make test`'s compileall saves each Python process the suite starts: the CPU of a fresh
interpreter importing what an aggregator process imports, from a copy of the project's packages
without .pyc (as every process found them on a machine with PYTHONDONTWRITEBYTECODE set), then
from the same copy after ``python -m compileall``, alternated, in one run.

    .venv/bin/python bench/import_compile.py [--repeats 8]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("aggregator", "edge_client", "export", "protocols", "fedfleet")
IMPORTS = "import aggregator.cli, aggregator.service.loop, fedfleet.simulate, edge_client.agent"


def child_cpu(code: str, root: pathlib.Path) -> float:
    """CPU seconds (user + system) of one fresh interpreter running ``code`` with ``root`` first on its path."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(root))
    subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bare, compiled = pathlib.Path(tmp) / "bare", pathlib.Path(tmp) / "compiled"
        for root in (bare, compiled):
            for package in PACKAGES:
                shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run([sys.executable, "-m", "compileall", "-q", *PACKAGES], cwd=compiled, check=True)
        child_cpu(IMPORTS, compiled)                    # warm the page cache for both
        times: dict[str, list[float]] = {"no .pyc": [], "compileall": []}
        for _ in range(args.repeats):                   # alternated: the machine's load hits both alike
            times["no .pyc"].append(child_cpu(IMPORTS, bare))
            times["compileall"].append(child_cpu(IMPORTS, compiled))
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, value in med.items():
        print(f"{name:>11}: {value:.3f} CPU-s per process (median of {args.repeats})")
    print(f"saved per process: {med['no .pyc'] - med['compileall']:.3f} CPU-s; "
          f"compiled/bare = {med['compileall'] / med['no .pyc']:.3f}")


if __name__ == "__main__":
    main()
