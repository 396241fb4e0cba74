"""The aggregator processes of the crash tests, forked from one process that imported the
aggregator once (the product's fork server, fedfleet/emulation/fork_server.py, the one
``fedfleet simulate`` starts its jobs' aggregators from), instead of each started by
``python -m aggregator``.

A crash test starts the aggregator tens of times (killed at a crash point, restarted on the same
state file), and every fresh interpreter spent ~2.5 s of CPU importing torch, numpy and the
aggregator before doing anything: most of such a test's time on CI's 2 cores. Here one server
per test process imports ``aggregator.cli`` (in the environment the aggregator processes get:
this checkout, one BLAS thread) and forks a child per start, which runs ``aggregator.cli.main``
with its own environment, working folder, argv and output file and exits as ``python -m
aggregator`` would. What the tests check is unchanged: each child is a separate process with
nothing but the imported modules in common with the next one (the server never runs ``main``),
restarts from its state file alone, is SIGKILLed by its own crash point, and the test sees its
exit status (-9) and output.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from fedfleet.emulation.fork_server import ForkedProcess, ForkServer

REPO = Path(__file__).resolve().parents[1]
ForkedAggregator = ForkedProcess

_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def shared_server() -> ForkServer:
    """This test process's server, started on first use (and again if it died)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive:
            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
            env.pop("FEDFLEET_CRASH_AT", None)
            # what every child imports first, and what ``serve`` imports on its way; the admin API's
            # app (FastAPI, ~0.6 CPU-s) too, which ``serve --api`` imports when it starts the API: the
            # crash tests create their jobs through it, so each first run imported it again
            _shared = ForkServer(["aggregator", "aggregator.api.server", "aggregator.service.loop",
                                  "aggregator.storage.store", "aggregator.deployments.controller",
                                  "aggregator.api.app"], env, cwd=REPO)
        return _shared


def start_aggregator(argv: list[str], env: dict, cwd: Path, log: Path) -> ForkedProcess:
    """``argv`` as ``[sys.executable, "-m", "aggregator", *args]`` (what ``aggregator_cmd`` builds)."""
    assert argv[1:3] == ["-m", "aggregator"], argv
    return shared_server().start("aggregator", argv[3:], log, env=env, cwd=cwd)


def run_aggregator_process(argv: list[str], env: dict, cwd: Path, log: Path, timeout: float) -> tuple[int, str]:
    """Run to its end (killed after ``timeout`` s, then TimeoutExpired as subprocess.run raises);
    (exit status, output)."""
    t0 = time.monotonic()
    proc = start_aggregator(argv, env, cwd, log)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise
    return rc, proc.output() + f"\n[{time.monotonic() - t0:.1f}s]"
