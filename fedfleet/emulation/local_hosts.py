"""Device hosts as local worker processes: ``python -m fedfleet.emulation.worker SPEC``, each a
fork of the fleet's host server (``fork_server.py``), which imported the device's code once.
The Ray counterpart, one host per actor on a cluster's machines, is ``ray_hosts.py``."""

from __future__ import annotations

import json
from pathlib import Path

from .fork_server import ForkedProcess, ForkServer
from .processes import stop_all


class LocalHosts:
    """Device hosts as local worker processes (``python -m fedfleet.emulation.worker SPEC``, forked
    from the fleet's server)."""

    def __init__(self, out: Path, processes: ForkServer, env: dict | None = None):
        """``env``: the hosts' environment (the server's by default)."""
        self.out, self.processes, self.env = out, processes, env
        self.procs: list[ForkedProcess] = []

    def start(self, specs: list[dict]) -> None:
        for w, spec in enumerate(specs):
            (self.out / f"worker{w}.spec.json").write_text(json.dumps(spec))
            self.procs.append(self.processes.start("fedfleet.emulation.worker", [str(self.out / f"worker{w}.spec.json")],
                                                   self.out / f"worker{w}.log", env=self.env))

    def stop(self) -> list[dict]:
        """Stop every worker; the statistics each wrote when it stopped."""
        stop_all(self.procs, first_is_done=False)
        return [json.loads((self.out / f"worker{w}.json").read_text())
                for w in range(len(self.procs)) if (self.out / f"worker{w}.json").exists()]
