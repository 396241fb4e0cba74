"""(a) Fed3R ingest at the aggregator over MQTT vs the broker's raw throughput, same payloads.

One run, one private mosquitto:
1. raw: a paho publisher sends K devices' encoded (chunked) result payloads to one subscriber
   that only counts bytes -> broker throughput for exactly these messages;
2. fedfleet: K real DeviceAgents answer a Fed3R task with precomputed statistics of dimension d;
   the AggregatorService reassembles, validates, sums and solves after every contribution.
Prints both rates and their ratio (aggregator ingest / raw broker).

    .venv/bin/python bench/fed3r_ingest.py [--devices 20] [--d 1280]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt

sys.path.insert(0, str(Path(__file__).parent))

from _synthetic import PrecomputedStats, run_in_thread  # noqa: E402

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob  # noqa: E402
from aggregator.service import AggregatorService  # noqa: E402
from edge_client.agent import DeviceAgent  # noqa: E402
from fedfleet.emulation.broker import MosquittoBroker  # noqa: E402
from protocols import messages as M  # noqa: E402
from protocols.chunking import split  # noqa: E402
from protocols.envelope import encode  # noqa: E402
from protocols.mqtt_link import BrokerConfig  # noqa: E402


def raw_rate(broker, payloads: list[bytes]) -> float:
    total = sum(len(p) for p in payloads)
    got = {"bytes": 0}
    done = threading.Event()

    def on_msg(c, u, msg):
        got["bytes"] += len(msg.payload)
        if got["bytes"] >= total:
            done.set()

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-sub")
    sub.on_message = on_msg
    sub.connect("127.0.0.1", broker.port)
    sub.subscribe("raw/#", qos=1)
    sub.loop_start()
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-pub")
    pub.max_inflight_messages_set(64)
    pub.connect("127.0.0.1", broker.port)
    pub.loop_start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    for i, p in enumerate(payloads):
        pub.publish(f"raw/{i % 50}", p, qos=1)
    done.wait(300)
    dt = time.perf_counter() - t0
    pub.loop_stop()
    sub.loop_stop()
    return total / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=20)
    ap.add_argument("--d", type=int, default=1280)
    args = ap.parse_args()
    C = 10
    handler = PrecomputedStats(args.d, C)
    with MosquittoBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        ids = [f"dev{i:04d}" for i in range(args.devices)]
        # the exact bytes the devices will send
        ref = M.TaskRef("j", 1, "0" * 32)
        payloads = []
        for dev in ids:
            msg = M.result_message(dev, ref, "fed3r.stats", *handler({}))
            payloads += split(encode(msg), msg.id, dev)
        raw = raw_rate(broker, payloads)

        print(f"devices={args.devices} d={args.d} payload per device={sum(map(len, payloads)) / args.devices / 1e6:.2f} MB")
        print(f"raw broker throughput (same chunked payloads):        {raw / 1e6:8.1f} MB/s")
        for provisional in (True, False):
            rate, n_ok = fedfleet_rate(broker, tmp, ids, handler, args.d, C, provisional)
            what = "validate+sum+solve+evaluate each" if provisional else "validate+sum, solve at the end "
            print(f"aggregator ingest ({what}): {rate / 1e6:8.1f} MB/s  ratio to raw {rate / raw:.2f}"
                  f"  (accepted={n_ok})")


def fedfleet_rate(broker, tmp, ids, handler, d, C, provisional: bool) -> tuple[float, int]:
    cfg = Fed3RConfig(num_classes=C, feature_dim=d, clients_per_round=len(ids), expected_devices=len(ids),
                      round_timeout_s=600)
    svc = AggregatorService(Fed3RJob(cfg), BrokerConfig.from_url(broker.url), Path(tmp) / str(provisional),
                            enrolled=set(ids), evaluate_every_contribution=provisional)
    agents = [DeviceAgent(dev, BrokerConfig.from_url(broker.url), {"fed3r.stats": handler},
                          retry_after_s=600).start() for dev in ids]
    t0 = time.perf_counter()
    t, out = run_in_thread(lambda: svc.run(timeout_s=900))
    t.join()
    wall = time.perf_counter() - t0     # includes connect + one task round trip: a conservative rate
    for a in agents:
        a.stop()
    return out["bytes_in"] / wall, out["results_accepted"]


if __name__ == "__main__":
    main()
