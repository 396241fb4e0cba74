"""A device process for tests/test_device_state_restart.py: one DeviceAgent serving ``pp.head``
with a DeviceStateStore on disk, on ops_fleet's synthetic features. It logs every task (round,
the stored state it found, whether it restarted) to a JSON-lines file; with ``--block-round R``
it blocks in round R's task until it is killed.

Run as ``python tests/pp_device_process.py DEVICE BROKER_URL STATE_DIR LOG [--block-round R]``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from edge_client.agent import DeviceAgent                     # noqa: E402
from edge_client.state import DeviceStateStore                # noqa: E402
from edge_client.tasks.partial_training import PartialTrainingTask  # noqa: E402
from ops_fleet import Features, data_for                      # noqa: E402
from protocols.mqtt_link import BrokerConfig                   # noqa: E402
from protocols.payloads.partial import KIND                    # noqa: E402


def handler_for(device: str, state_dir: Path):
    Z, y = data_for(device)
    held = np.random.default_rng(7).normal(size=(10, Z.shape[1])).astype(np.float32)
    return PartialTrainingTask(Z.astype(np.float32), y, lambda *a, **k: Features(), DeviceStateStore(state_dir),
                               held, np.arange(10) % 3)


def main(argv: list[str]) -> None:
    device, broker, state_dir, log = argv[:4]
    block = int(argv[5]) if len(argv) > 5 and argv[4] == "--block-round" else None
    task = handler_for(device, Path(state_dir))

    def logged(params, tensors):
        entry = task.store.load(params["job_id"], None)
        record = {"round": params["state"]["round"], "stored_round": entry.round if entry else None,
                  "stored_bias": entry.arrays["bias"].tolist() if entry else None}
        with open(log, "a") as f:
            f.write(json.dumps({**record, "event": "start"}) + "\n")
        if params["state"]["round"] == block:
            time.sleep(600)                                   # killed here, mid-task
        body, out = task(params, tensors)
        with open(log, "a") as f:
            f.write(json.dumps({**record, "event": "done", "restarted": body["restarted"]}) + "\n")
        return body, out

    DeviceAgent(device, BrokerConfig.from_url(broker), {KIND: logged}, retry_after_s=1, tick_s=0.05).start()
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])
