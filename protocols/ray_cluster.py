"""Joining a Ray cluster, for either side that places work on one: the emulated fleet's device
hosts (``fedfleet simulate --ray``, ``fedfleet/emulation/ray_hosts.py``) and the aggregator's
shards (``aggregator serve --shards K --ray``, ``aggregator/shards/ray_shards.py``). Ray only
places and reaches those processes; devices and shards still speak MQTT to the broker.

Ray is an optional extra: ``pip install 'fedfleet[ray]'``.
"""

from __future__ import annotations

import socket
from pathlib import Path

CODE_ROOT = Path(__file__).resolve().parents[1]         # the checkout this process runs from


def join_ray(address: str):
    """``(ray, joined)``: the ray module, connected to the cluster at ``address`` ("auto": the
    local cluster started with ``ray start``; else its head's host:port) unless this process is
    connected already; ``joined`` says this call connected it (its caller then ends the session
    with ``ray.shutdown()``). A missing Ray is one clear error."""
    try:
        import ray
    except ImportError as exc:
        raise SystemExit("--ray needs Ray: pip install 'fedfleet[ray]'") from exc
    if ray.is_initialized():
        return ray, False
    check_reachable(address)
    # The actors import fedfleet from this checkout when the cluster's nodes share this machine's
    # file system (a local cluster); a real cluster installs fedfleet on every node. One BLAS
    # thread each: an actor is given one CPU.
    ray.init(address=address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(CODE_ROOT), "OMP_NUM_THREADS": "1"}})
    return ray, True


def check_reachable(address: str, timeout: float = 3.0) -> None:
    """Fail fast (ConnectionError, one clear line) when nothing listens at a cluster's host:port:
    ``ray.init`` would retry for minutes. ("auto" finds the local cluster or fails by itself.)"""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except ValueError:
        raise ValueError(f"--ray {address}: not auto or host:port") from None
    except OSError as exc:
        raise ConnectionError(f"cannot reach the Ray cluster at {address} ({exc.strerror or type(exc).__name__}): "
                              f"is its head running (ray start --head), and is --ray right?") from None
