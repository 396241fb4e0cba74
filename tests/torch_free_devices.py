"""Python devices in a torch-free interpreter, for the mixed-fleet test (tests/test_java_device.py).

Run with ``.venv-device/bin/python`` (only ``fedfleet[device]`` installed) and one argument: a JSON
file ``{"broker": url, "aggregator_key": hex, "devices": [{"id", "features", "identity"}]}`` where
``features`` is a FeatureFile (what the Java devices read: int32 n, int32 d, n·d float32, n int32
labels, little-endian) and ``identity`` the device's Ed25519 PEM. Each device is a DeviceAgent with
the real Fed3R statistics handler on those features and the secure handlers a ``fedfleet device``
gets (edge_client.handlers.secure_handlers), signing every envelope and taking only what the
aggregator signed. Exits 3 if torch can be imported here; prints ``ONLINE <id>`` once connected and
``STATS <id> done=… declined=…`` after stopping (stdin EOF or SIGTERM), like HeadlessDevices.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import threading
from pathlib import Path

import numpy as np


def read_features(path: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = path.read_bytes()
    n, d = np.frombuffer(raw, "<i4", 2)
    Z = np.frombuffer(raw, "<f4", n * d, offset=8).reshape(n, d)
    return Z, np.frombuffer(raw, "<i4", n, offset=8 + 4 * n * d).astype(np.int64)


def main(config_path: str) -> int:
    if importlib.util.find_spec("torch") is not None:
        print("torch is importable in this interpreter: not a torch-free device", file=sys.stderr)
        return 3
    # the tests' stand-in backbone: the synthetic rows already are features
    from ops_fleet import Features

    from edge_client.agent import DeviceAgent
    from edge_client.handlers import secure_handlers
    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from protocols.identity import DeviceIdentity
    from protocols.mqtt_link import BrokerConfig
    from protocols.payloads.fed3r import KIND as FED3R_KIND

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())    # before the first ONLINE: a caller may stop us then
    config = json.loads(Path(config_path).read_text())
    aggregator_key = bytes.fromhex(config["aggregator_key"])
    agents = []
    for device in config["devices"]:
        Z, y = read_features(Path(device["features"]))
        identity = DeviceIdentity.from_pem(device["id"], Path(device["identity"]).read_bytes())
        handlers = {FED3R_KIND: Fed3RStatsTask(Z, y, lambda b, s, w, d=Z.shape[1]: Features(d))}
        agents.append(DeviceAgent(device["id"], BrokerConfig.from_url(config["broker"]), {},
                                  protocol_handlers=secure_handlers(identity, aggregator_key, handlers),
                                  signer=identity.sign, aggregator_key=aggregator_key, retry_after_s=2).start())
        print(f"ONLINE {device['id']}", flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stop.wait()
    for agent in agents:
        agent.stop()
        print(f"STATS {agent.device_id} done={agent.stats.tasks_done} declined={agent.stats.tasks_declined}",
              flush=True)
    assert "torch" not in sys.modules, "a device module imported torch"
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
