"""What the Java task tests' runs cost: ``java TaskRunner ARGS`` as a JVM per run, against the same
runs in one ``TaskRunner --serve`` JVM (tests/java_tasks.py ``ServedTaskRunner``, what the suite
uses). Each run draws 5,000 Skellam noise values (``--skellam``), so the difference is the JVM's
start and the warm-up of the device code it runs. CPU-seconds from this process's reaped children (getrusage), both ways in this
one run, and their ratio.

    .venv/bin/python bench/java_task_runs.py [--runs 20]
"""

from __future__ import annotations

import argparse
import pathlib
import resource
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import java_build  # noqa: E402
from java_tasks import ServedTaskRunner  # noqa: E402

RUN = ["--skellam", "4.0", "5000"]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    if java_build.missing():
        sys.exit(java_build.missing())
    cp = java_build.built()
    cpu0, t0 = children_cpu(), time.monotonic()
    for _ in range(args.runs):
        proc = subprocess.run(java_build.java_command("-cp", cp, "TaskRunner", *RUN), capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout.startswith("NOISE"), proc.stderr
    per_jvm, per_jvm_wall = children_cpu() - cpu0, time.monotonic() - t0
    cpu0, t0 = children_cpu(), time.monotonic()
    runner = ServedTaskRunner(cp)
    for _ in range(args.runs):
        status, text = runner.run(RUN)
        assert status == "OK" and text.startswith("NOISE"), text
    runner.close()                      # waited for: its CPU is in RUSAGE_CHILDREN
    served, served_wall = children_cpu() - cpu0, time.monotonic() - t0
    print(f"{args.runs} TaskRunner runs: a JVM each {per_jvm:.2f} CPU-s ({per_jvm_wall:.1f} s), "
          f"one served JVM {served:.2f} CPU-s ({served_wall:.1f} s)")
    print(f"served / a JVM each: CPU {served / per_jvm:.2f}x, wall {served_wall / per_jvm_wall:.2f}x; "
          f"{(per_jvm - served) / args.runs:.2f} CPU-s saved per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
