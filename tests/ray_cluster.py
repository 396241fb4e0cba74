"""A two-node Ray cluster on this machine for the Ray tests: a head and a second node joined with
``ray start --address``, one CPU each, each with the custom resources a test asks for (so it can
place an actor on a chosen node); torn down with ``ray stop`` afterwards."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

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

    try:
        ray_start("--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", str(temp),
                  "--resources", json.dumps(resources[0]))
        ray_start("--address", f"127.0.0.1:{port}", "--resources", json.dumps(resources[1]))
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
