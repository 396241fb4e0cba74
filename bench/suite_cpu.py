"""Where a command's CPU goes, by kind of process (the test suite, a simulation): how busy the
machine was while it ran, and the CPU-seconds of every process seen, grouped by what it is
(pytest's xdist workers, the service's fork-server workers, fedfleet's fork servers and their
children — simulate's aggregators and device hosts, the tests' aggregators —, Ray, JVMs, brokers
...), with a count of processes per group.

``--durations`` and the suite's own ``FEDFLEET_CPU_PROFILE`` (tests/cpu_profile.py) see a test's
process and the children it reaps; this sees every process on the machine, sampled from /proc
once a second (a process that lives under a second may be missed; one that forks without exec
keeps its parent's command line, so fork-server workers are grouped under their server's).
Processes older than the command count from their first sample; kernel threads are left out.
The machine should run nothing else meanwhile.

    .venv/bin/python bench/suite_cpu.py -- .venv/bin/python -m pytest -q -n 4 --dist loadfile --no-loadscope-reorder
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")

# (what the command line holds, the group's name), first match wins
GROUPS = (
    ("mosquitto", "mosquitto"),
    ("raylet", "ray"), ("gcs_server", "ray"), ("ray::", "ray"), ("/ray/", "ray"),
    ("java", "jvm"),
    ("chrom", "chromium"),
    ("multiprocessing.forkserver", "fork-server workers"),
    ("multiprocessing.spawn", "spawned workers"),
    ("fedfleet.emulation.fork_server", "fedfleet fork servers and children (aggregators, device hosts)"),
    ("-m aggregator", "aggregator processes"),
    ("import sys;exec(eval(sys.stdin.readline()))", "pytest-xdist workers"),
    ("pytest", "pytest"),
    ("fedfleet", "fedfleet commands"),
)


def group_of(cmdline: str) -> str:
    for needle, group in GROUPS:
        if needle in cmdline:
            return group
    return cmdline.split(" ")[0].rsplit("/", 1)[-1][:40]


def machine_ticks() -> tuple[int, int]:
    """(all ticks, idle ticks) since boot, every CPU."""
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def uptime_ticks() -> int:
    return int(float(open("/proc/uptime").read().split()[0]) * HZ)


def sample(seen: dict[tuple[int, int], list], me: int, started: int) -> None:
    """Each live process's CPU since the command started (utime + stime; a process older than the
    command counts from its first sample), its group fixed when first seen; kernel threads
    (no command line) are left out."""
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            stat = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()
            start, cpu = int(stat[19]), (int(stat[11]) + int(stat[12])) / HZ
            key = (int(name), start)                        # a reused pid is another process
            if key not in seen:
                cmdline = open(f"/proc/{name}/cmdline").read().replace("\0", " ").strip()
                if not cmdline:
                    continue
                seen[key] = [group_of(cmdline), cpu if start < started else 0.0, cpu]
            else:
                seen[key][2] = cpu
        except (OSError, IndexError, ValueError):
            continue                                        # it ended meanwhile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --")
    seen: dict = {}
    ticks0, idle0, t0, started = *machine_ticks(), time.monotonic(), uptime_ticks()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        sample(seen, os.getpid(), started)
        time.sleep(args.interval)
    ticks1, idle1 = machine_ticks()
    cpu, count = collections.Counter(), collections.Counter()
    for group, first, last in seen.values():
        if last - first > 0 or first == 0.0:
            cpu[group] += last - first
            count[group] += 1
    wall = time.monotonic() - t0
    print(f"\n{' '.join(command)[:100]}: exit {proc.returncode}, {wall:.0f} s, the machine "
          f"{100 * (1 - (idle1 - idle0) / (ticks1 - ticks0)):.1f} % busy ({os.cpu_count()} CPUs); "
          f"{sum(cpu.values()):.0f} CPU-s in the processes seen")
    print(f"{'CPU-s':>8} {'share':>6} {'procs':>6}  group")
    total = sum(cpu.values()) or 1.0
    for group, seconds in cpu.most_common():
        print(f"{seconds:>8.1f} {seconds / total:>6.1%} {count[group]:>6}  {group}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
