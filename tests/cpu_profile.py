"""CPU seconds per test, for finding where the suite's time goes on a loaded machine: wall-clock
durations (``--durations``) stretch with the load and count waits on shared builds, CPU time
does not. On with ``FEDFLEET_CPU_PROFILE=<file>``: each test's CPU (the test process's own plus
the children it reaped — brokers, aggregator subprocesses, JVMs) is appended to ``<file>`` as
``seconds<TAB>node id<TAB>xdist worker<TAB>wall start<TAB>wall end`` lines (epoch seconds; the test's
setup and teardown included); sum them by file with ``sort``/``awk``, or lay the wall columns out per
worker to see which files run last and alone.

What it does not see, so the sum is a lower bound: processes the test's own children reap (Ray's
workers, started by the Ray node; the crash tests' aggregators, forked and reaped by
``aggregator_forkserver``, whose CPU lands on the test running when that server exits), and a
module-scoped process's CPU is booked to the module's last test, at teardown."""

from __future__ import annotations

import os
import resource
import time

import pytest

_TARGET = os.environ.get("FEDFLEET_CPU_PROFILE")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _TARGET:
        yield
        return
    start, wall_start = _cpu_seconds(), time.time()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
    with open(_TARGET, "a") as out:      # one short append per test: xdist workers' lines do not interleave
        out.write(f"{_cpu_seconds() - start:.2f}\t{item.nodeid}\t{worker}\t{wall_start:.1f}\t{time.time():.1f}\n")
