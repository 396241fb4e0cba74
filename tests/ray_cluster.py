"""A two-node Ray cluster on this machine for the Ray tests: a head and a second node joined with
``ray start --address``, one CPU each, each with the custom resources a test asks for (so it can
place an actor on a chosen node); torn down afterwards by stopping exactly that cluster's
processes (``ray stop`` would stop every Ray process on the machine, another test worker's cluster
too). One cluster at a time (a file lock): two would only fight over the 2 cores."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]


def head_port() -> int:
    """A port free on every address, below the ephemeral range (32768+): the head's gRPC server
    binds 0.0.0.0, and on a machine holding a large emulated fleet's connections an ephemeral port
    free on 127.0.0.1 was seen refused there (every one of 7 tries; none of 5 below the range)."""
    while True:
        port = random.randrange(20000, 32000)
        try:
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))
            return port
        except OSError:
            continue


@contextmanager
def two_node_ray_cluster(resources: tuple[dict, dict] = ({}, {})):
    """Yields the head's address (host:port); ``resources``: the head's and the second node's."""
    import ray

    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    assert ray_bin, "the ray CLI comes with fedfleet[ray]"
    port = head_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    common = ["--num-cpus", "1", "--disable-usage-stats"]
    temp = Path("/tmp") / f"ray-fedfleet-{os.getpid()}"      # ray wants a short socket path

    def ray_start(*args: str) -> None:
        proc = subprocess.run([ray_bin, "start", *args, *common], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"ray start {' '.join(args)}: {proc.stderr[-2000:]}"

    with FileLock("/tmp/fedfleet-ray-tests.lock"):
        try:
            ray_start("--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", str(temp),
                      "--resources", json.dumps(resources[0]))
            ray_start("--address", f"127.0.0.1:{port}", "--resources", json.dumps(resources[1]))
            yield f"127.0.0.1:{port}"
        finally:
            if ray.is_initialized():
                ray.shutdown()
            stop_cluster(temp, port)
            shutil.rmtree(temp, ignore_errors=True)


def stop_cluster(temp: Path, port: int, grace_s: float = 3.0) -> None:
    """End every process of the cluster: those that name its temp dir (session) or its head's port
    on their command line (head, second node), and their descendants (agents and workers retitle
    themselves ``ray::...``), found before any is signalled. SIGTERM, then SIGKILL after
    ``grace_s``: the raylets end at once, but the GCS server and the autoscaler's monitor were seen
    to outlive a SIGTERM by more than 10 s (a test cluster keeps nothing worth a graceful end)."""
    marks = (str(temp).encode(), f"127.0.0.1:{port}".encode(), f"--port={port}".encode(), f"--port {port}".encode())
    cluster: set[int] = set()

    def scan() -> None:
        parents = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if any(m in cmdline for m in marks):
                cluster.add(int(proc.name))
        grown = True
        while grown:
            more = {pid for pid, parent in parents.items() if parent in cluster} - cluster
            cluster.update(more)
            grown = bool(more)

    def alive() -> list[int]:
        running = []
        for pid in cluster:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue            # gone
            if state != "Z":
                running.append(pid)
        return running

    scan()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive():
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)


class SharedCluster:
    """One two-node cluster for every test of a pytest process that asks for it: started by the
    first, kept while the tests that need it run back to back, stopped by :meth:`close` (conftest
    calls it after the last of a run of such tests, and at the session's end). Both nodes hold
    every custom resource those tests ask for (``RESOURCES``), so one cluster serves them all;
    each ``ray start`` costs seconds of CPU and its stop seconds more."""

    RESOURCES = ({"fedfleet_shard_0": 1}, {"fedfleet_shard_1": 1})    # aggregator/shards/ray_shards.py

    def __init__(self):
        self._cluster = None
        self.address: str | None = None

    def get(self) -> str:
        """The head's address (host:port), the cluster started if it is not running."""
        if self.address is None:
            cluster = two_node_ray_cluster(self.RESOURCES)
            self.address = cluster.__enter__()
            self._cluster = cluster
        return self.address

    def close(self) -> None:
        cluster, self._cluster, self.address = self._cluster, None, None
        if cluster is not None:
            cluster.__exit__(None, None, None)
