"""Device hosts as Ray actors: a fleet spread over the machines of a Ray cluster.

Each actor is one :class:`~fedfleet.emulation.host.DeviceHost` hosting its share of the devices,
exactly what a local worker process does (:func:`fedfleet.emulation.worker.host_devices`); the
devices speak MQTT to the broker, never to Ray. Ray only places the hosts (one CPU each, spread
over the nodes) and carries their specs and final statistics. The specs carry the devices' data
indices inline, so a node needs no shared disk, only fedfleet and the dataset (``load_dataset``
reads its own local copy) and a route to the broker (``--broker`` with an address the nodes reach).

Ray is an optional extra: ``pip install 'fedfleet[ray]'``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from protocols.log_text import log_to_stderr
from protocols.ray_cluster import join_ray


class DeviceHostActor:
    """The actor body (wrapped by ``ray.remote`` in :class:`RayHosts`)."""

    def __init__(self, spec: dict):
        from .worker import host_devices

        # its devices log what the aggregator and the broker sent (a rejection's reason, a job's
        # id): one line each, escaped and cut, as in a local worker process; force: a Ray worker
        # may come with a handler of its own
        log_to_stderr(force=True)
        self.node = os.uname().nodename
        self.host, self.agents = host_devices(spec)

    def where(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "devices": len(self.agents),
                "pid": os.getpid()}

    def connected(self) -> int:
        return len(self.host.connected())

    def stop(self) -> dict:
        from .worker import stop_devices

        return stop_devices(self.host, self.agents)


def _inline(spec: dict, name: str) -> dict:
    """The spec with its devices' indices from ``spec[name + '_file']`` carried inline."""
    path = spec.get(f"{name}_file")
    if not path:
        return spec
    with np.load(path) as f:
        rows = {d["profile"]["device_id"]: f[d["profile"]["device_id"]].tolist() for d in spec["devices"]}
    return {**spec, f"{name}_file": None, name: rows}


class RayHosts:
    """Starts one :class:`DeviceHostActor` per spec on the cluster at ``address`` ("auto": the
    local cluster started with ``ray start``), spread over its nodes."""

    def __init__(self, address: str, out: Path):
        self.ray, self.own_session = join_ray(address)
        self.out = out
        self.actors: list = []
        self.placement: list[dict] = []

    def start(self, specs: list[dict]) -> None:
        remote = self.ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(DeviceHostActor)
        for spec in specs:
            spec = _inline(_inline(spec, "shards"), "holdout")
            self.actors.append(remote.remote(spec))
        self.placement = self.ray.get([a.where.remote() for a in self.actors])

    def stop(self) -> list[dict]:
        stats = self.ray.get([a.stop.remote() for a in self.actors])
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
        if self.own_session:
            self.ray.shutdown()
        return stats
