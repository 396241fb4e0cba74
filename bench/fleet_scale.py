"""(c) Emulated devices per second and memory per device.

Starts N real DeviceAgents (own MQTT connection, agent thread, session) in this process, with a
Fed3R handler returning precomputed statistics, against a private mosquitto and an in-process
aggregator asking all of them at once. Prints: agents started per second, resident memory per
agent (RSS delta / N), and end-to-end contributions per second through the aggregator.

    .venv/bin/python bench/fleet_scale.py [--devices 200] [--d 64]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _synthetic import PrecomputedStats, run_in_thread  # noqa: E402

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob  # noqa: E402
from aggregator.service import AggregatorService  # noqa: E402
from edge_client.agent import DeviceAgent  # noqa: E402
from fedfleet.emulation.broker import MosquittoBroker  # noqa: E402
from protocols.mqtt_link import BrokerConfig  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--d", type=int, default=64)
    args = ap.parse_args()
    handler = PrecomputedStats(args.d, 10)
    extra = "max_connections -1\n"
    with MosquittoBroker(extra_config=extra) as broker, tempfile.TemporaryDirectory() as tmp:
        ids = [f"dev{i:05d}" for i in range(args.devices)]
        cfg = Fed3RConfig(num_classes=10, feature_dim=args.d, clients_per_round=args.devices,
                          expected_devices=args.devices, round_timeout_s=600, start_timeout_s=600)
        svc = AggregatorService(Fed3RJob(cfg), BrokerConfig.from_url(broker.url), Path(tmp), enrolled=set(ids),
                                evaluate_every_contribution=False)
        t, out = run_in_thread(lambda: svc.run(timeout_s=900))
        time.sleep(0.5)
        m0 = rss_mb()
        t0 = time.perf_counter()
        agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": handler},
                              retry_after_s=600).start() for d in ids]
        t_start = time.perf_counter() - t0
        m1 = rss_mb()
        t.join()
        t_total = time.perf_counter() - t0
        for a in agents:
            a.stop()
    print(f"devices={args.devices} (one process, one MQTT connection + thread each)")
    print(f"agents started: {args.devices / t_start:.1f} devices/s")
    print(f"memory per agent: {(m1 - m0) / args.devices:.2f} MB RSS (process incl. aggregator: {m1:.0f} MB)")
    print(f"end to end (start, connect, task, stats, validate, sum, solve): {out['results_accepted'] / t_total:.1f} contributions/s")


if __name__ == "__main__":
    main()
