"""(c) Emulated devices per second, memory per idle device and contributions per second, at two
fleet sizes in one run, so the growth is visible.

For each size (1,000 and ``--devices``): a private mosquitto, the aggregator as its own process
(``python -m aggregator serve``, a Fed3R job asking every device at once) and, in this process,
N real edge_client DeviceAgents on one :class:`fedfleet.emulation.host.DeviceHost` (own MQTT
connection, client id, session and last will each; one MQTT event loop, no thread per device).
Each device's handler returns precomputed Fed3R statistics through the host's compute slot, so
the bench measures hosting and transport, not the backbone. Prints: devices started per second
(until connected), RSS per idle device (this process's RSS growth / N), and contributions per
second end to end (first device started to the aggregator's final model).

    .venv/bin/python bench/fleet_scale.py [--devices 10000] [--d 64]

Measured (shared 2-core machine, --devices 10000): 1,000 devices: 901 started/s, 24 KiB per idle
device, 123 contributions/s; 10,000 devices: 370 started/s, 21 KiB per idle device, 104/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _synthetic import PrecomputedStats  # noqa: E402

from edge_client.agent import DeviceAgent  # noqa: E402
from fedfleet.emulation.broker import FLEET_BROKER_CONFIG, MosquittoBroker  # noqa: E402
from fedfleet.emulation.host import DeviceHost, LazyTasks, rss_mb  # noqa: E402
from protocols.mqtt_eventloop import raise_open_file_limit  # noqa: E402
from protocols.mqtt_link import BrokerConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def start_aggregator(url: str, work: Path, ids: list[str], d: int) -> subprocess.Popen:
    job = {"job_id": "scale", "num_classes": 10, "feature_dim": d, "clients_per_round": len(ids),
           "expected_devices": len(ids), "round_timeout_s": 900, "start_timeout_s": 900, "max_attempts": 1}
    (work / "job.json").write_text(json.dumps(job))
    (work / "enrolled.txt").write_text("\n".join(ids) + "\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "aggregator", "serve", "--config", str(work / "job.json"),
                             "--kind", "fed3r", "--broker", url, "--out", str(work / "out"),
                             "--enrolled", str(work / "enrolled.txt"), "--timeout", "1200"],
                            env=env, stdout=open(work / "aggregator.log", "w"), stderr=subprocess.STDOUT)


def measure(n: int, d: int, url: str, work: Path) -> dict:
    ids = [f"dev{i:05d}" for i in range(n)]
    agg = start_aggregator(url, work, ids, d)
    stats = PrecomputedStats(d, 10)
    host = DeviceHost(step_threads=8, tick_s=2.0)
    m0 = rss_mb()
    t0 = time.perf_counter()
    for dev in ids:
        tasks = LazyTasks(lambda: {"fed3r.stats": stats}, ["fed3r.stats"], host.compute_slot)
        host.add(lambda lf, dev=dev, tasks=tasks: DeviceAgent(dev, BrokerConfig.from_url(url), tasks.handlers(),
                                                              retry_after_s=600, link_factory=lf))
    connected = host.wait_connected(timeout_s=300)
    t_connected = time.perf_counter() - t0
    m1 = rss_mb()
    rc = agg.wait(timeout=1800)
    t_done = time.perf_counter() - t0
    time.sleep(2 * host.tick_s)          # every device has handled its ack: idle again
    m2 = rss_mb()
    results = json.loads((work / "out" / "results.json").read_text()) if (work / "out" / "results.json").exists() else {}
    host.stop()
    return {"devices": n, "connected": connected, "started_per_s": n / t_connected,
            "rss_mb_per_device": (m1 - m0) / n, "process_rss_mb": m1, "aggregator_exit": rc,
            "rss_mb_per_device_after_work": (m2 - m0) / n,
            "contributed": len(results.get("contributed", [])), "contributions_per_s":
            len(results.get("contributed", [])) / t_done, "wall_s": t_done, "open_file_limit": host.open_file_limit}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2000)
    ap.add_argument("--d", type=int, default=64, help="feature dimension of the synthetic statistics")
    ap.add_argument("--small", type=int, default=1000, help="the smaller fleet measured first")
    args = ap.parse_args()
    raise_open_file_limit()
    rows = []
    for n in sorted({min(args.small, args.devices), args.devices}):
        with MosquittoBroker(extra_config=FLEET_BROKER_CONFIG) as broker, tempfile.TemporaryDirectory() as tmp:
            rows.append(measure(n, args.d, broker.url, Path(tmp)))
        r = rows[-1]
        print(f"devices={r['devices']:>6}  connected={r['connected']}  started {r['started_per_s']:.0f} devices/s  "
              f"RSS {r['rss_mb_per_device'] * 1024:.0f} KiB per idle device, "
              f"{r['rss_mb_per_device_after_work'] * 1024:.0f} KiB after its task (process {r['process_rss_mb']:.0f} MB)  "
              f"{r['contributed']} contributions in {r['wall_s']:.1f}s = {r['contributions_per_s']:.0f}/s", flush=True)
    if len(rows) == 2:
        a, b = rows
        print(f"growth x{b['devices'] / a['devices']:.0f} devices: start rate x{b['started_per_s'] / a['started_per_s']:.2f}, "
              f"RSS per device x{b['rss_mb_per_device'] / max(a['rss_mb_per_device'], 1e-9):.2f}, "
              f"contributions/s x{b['contributions_per_s'] / max(a['contributions_per_s'], 1e-9):.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
