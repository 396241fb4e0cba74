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

        cfg = Fed3RConfig(num_classes=C, feature_dim=args.d, clients_per_round=args.devices,
                          expected_devices=args.devices, round_timeout_s=600)
        svc = AggregatorService(Fed3RJob(cfg), BrokerConfig.from_url(broker.url), Path(tmp), enrolled=set(ids))
        agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": handler},
                              retry_after_s=600).start() for d in ids]
        t, out = run_in_thread(lambda: svc.run(timeout_s=900))
        t.join()
        for a in agents:
            a.stop()
        rounds = out["rounds"]
        hist = out["history"]
        # ingest window: from the round opening (first task) to the last accepted contribution
        t_first_task = min(h["t"] for h in hist) - (hist[1]["t"] - hist[0]["t"] if len(hist) > 1 else 0)
        window = hist[-1]["t"] - t_first_task
        ingest = out["bytes_in"] / window
        print(f"devices={args.devices} d={args.d} bytes per device={out['bytes_in'] / args.devices / 1e6:.2f} MB")
        print(f"raw broker throughput (same chunked payloads): {raw / 1e6:8.1f} MB/s")
        print(f"aggregator Fed3R ingest (validate+sum+solve):  {ingest / 1e6:8.1f} MB/s"
              f"  = {args.devices / window:.1f} contributions/s")
        print(f"ratio ingest/raw: {ingest / raw:.2f}   (rounds={len(rounds)}, accepted={out['results_accepted']})")


if __name__ == "__main__":
    main()
