"""(a) Fed3R ingest at the aggregator over MQTT vs the broker's raw throughput, the same payloads.

One run, one private mosquitto, the same publisher for both:
1. the devices (K ids on one paho client in this process) announce themselves, receive their
   Fed3R task from the aggregator and encode their results (precomputed statistics of dimension
   d, chunked as a device chunks them) — device work, not timed;
2. raw: those exact chunk payloads go through the broker to a subscriber *process* that only
   counts bytes -> the broker's throughput for exactly these messages;
3. aggregator: the same payloads go to the devices' outboxes, where the aggregator (its own
   process, a durable SQLite store with synchronous=FULL, ``--ingest-workers`` worker processes)
   reassembles, verifies, validates (one Cholesky per Gram matrix), stores before acking and sums
   them; timed from the first byte published to the job finished (its final state committed,
   ``finished_at``; not the service's shutdown after it): with "solve at the end", that includes
   the final re-sum in canonical order, the solve and the
   store's final commit.
4. the same with K shard processes (``aggregator serve --shards K``, ``aggregator/shards/``): each
   receives, validates, stores and sums its buckets' devices; the coordinator reduces their sums.
Prints the rates, their ratio (aggregator ingest / raw broker) and the CPU-seconds per result
(the whole machine's busy time: broker, publisher and every aggregator process).

    .venv/bin/python bench/fed3r_ingest.py [--devices 20] [--d 1280] [--ingest-workers 0 2] [--shards 1 2 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt

sys.path.insert(0, str(Path(__file__).parent))

from _synthetic import PrecomputedStats  # noqa: E402

from fedfleet.emulation.broker import MosquittoBroker  # noqa: E402
from protocols import messages as M  # noqa: E402
from protocols.chunking import split  # noqa: E402
from protocols.envelope import decode, encode  # noqa: E402
from protocols.topics import Topics  # noqa: E402

C = 10


def publisher(port: int) -> mqtt.Client:
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bench-pub-{time.monotonic_ns()}")
    pub.max_inflight_messages_set(64)
    pub.connect("127.0.0.1", port)
    pub.loop_start()
    return pub


def burst(pub: mqtt.Client, messages: list[tuple[str, bytes]]) -> float:
    """Publish everything (QoS 1); returns the wall-clock time of the first publish."""
    t0 = time.time()
    infos = [pub.publish(topic, payload, qos=1) for topic, payload in messages]
    for info in infos:
        info.wait_for_publish(300)
    return t0


# ---------------------------------------------------------------------- the two consumers (own processes)
def count_bytes(port: int, total: int, ready, out) -> None:
    got = {"bytes": 0}
    done = threading.Event()

    def on_msg(c, u, msg):
        got["bytes"] += len(msg.payload)
        if got["bytes"] >= total:
            out.put(time.time())
            done.set()

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-sub")
    sub.on_message = on_msg
    sub.on_subscribe = lambda *a: ready.set()
    sub.connect("127.0.0.1", port)
    sub.subscribe("raw/#", qos=1)
    sub.loop_start()
    done.wait(600)
    sub.loop_stop()


def run_aggregator(url: str, tmp: str, ids: list[str], d: int, provisional: bool, workers: int, ready, out,
                   shards: int = 0) -> None:
    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.service.loop import AggregatorService
    from aggregator.service.settings import ServiceSettings
    from aggregator.shards.local import LocalShards
    from aggregator.storage.store import Store
    from protocols.mqtt_link import BrokerConfig

    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)    # on a shared 2-core machine, more intra-op threads only wait for each other
    threadpool_limits(1)        # LAPACK's (the solve; the Gram check when inline) likewise
    cfg = Fed3RConfig(num_classes=C, feature_dim=d, clients_per_round=len(ids), expected_devices=len(ids),
                      round_timeout_s=600, job_id=f"ingest-{provisional}")
    broker = BrokerConfig.from_url(url)
    svc = AggregatorService(Fed3RJob(cfg), broker, Path(tmp),
                            ServiceSettings(evaluate_every_contribution=provisional, ingest_workers=workers),
                            enrolled=set(ids), store=Store(Path(tmp) / "state.db"),
                            shards=LocalShards(shards, broker, Path(tmp) / "shards") if shards else None)
    if svc.ingest is not None:
        for f in svc.ingest.warming:          # a serving aggregator's workers are up: don't time their start
            f.result()
    stop_shards = None
    if svc.shards is not None:      # stopped after the summary is out: their interpreters' teardown is no ingest
        stop_shards, svc.shards.close = svc.shards.close, lambda: None
    ready.set()
    summary = svc.run(timeout_s=900)
    out.put((summary["finished_at"], summary["bytes_in"], summary["results_accepted"], svc.store.commit_seconds))
    if stop_shards is not None:
        stop_shards()


# ---------------------------------------------------------------------- the devices
class Devices:
    """K device ids on one client: presence, then each one's encoded result once its task arrives."""

    def __init__(self, port: int, ids: list[str], handler: PrecomputedStats, topics: Topics = Topics()):
        self.ids, self.handler, self.topics = ids, handler, topics
        self.tasks: dict[str, M.TaskRef] = {}
        self.all_tasks = threading.Event()
        self.client = publisher(port)
        self.client.on_message = self._on_message
        for dev in ids:
            self.client.subscribe(topics.inbox(dev), qos=1)
            self.client.publish(topics.presence(dev), encode(M.presence_message(dev, "online")), qos=1, retain=True)

    def _on_message(self, c, u, msg):
        env = decode(msg.payload)
        if env.type == M.TASK and env.sender:
            ref = M.parse_task(env)[0]
            self.tasks[self.topics.device_of(msg.topic)] = ref
            if len(self.tasks) == len(self.ids):
                self.all_tasks.set()

    def results(self) -> list[tuple[str, bytes]]:
        out = []
        for dev in self.ids:
            self.whole = encode(M.result_message(dev, self.tasks[dev], "fed3r.stats", *self.handler({})))
            out += [(self.topics.outbox(dev), chunk) for chunk in split(self.whole, decode(self.whole).id, dev)]
        return out

    def close(self) -> None:
        for dev in self.ids:
            self.client.publish(self.topics.presence(dev), b"", qos=1, retain=True)   # clear the retained presence
        self.client.loop_stop()
        self.client.disconnect()


def validation_cpu_s(whole: bytes, d: int) -> float:
    """CPU seconds this machine takes to validate one result as an ingest worker does (full decode,
    the job's message-only checks: the Gram check is most of it), on one thread."""
    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob

    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    job = Fed3RJob(Fed3RConfig(num_classes=C, feature_dim=d))
    with threadpool_limits(1):          # LAPACK on one thread, as in a worker
        job.check_payload(decode(whole))
        t0 = time.process_time()
        for _ in range(3):
            job.check_payload(decode(whole))
        return (time.process_time() - t0) / 3


def busy_cpu_s() -> float | None:
    """CPU-seconds all processes of this machine have used so far (Linux ``/proc/stat``: every state
    but idle and I/O wait); None elsewhere."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def durable_write_s(data: bytes, directory: str, repeats: int = 5) -> float:
    """Seconds this disk takes to make one result durable as the store does (its payload file
    written, O_DIRECT where the file system allows it, and fsynced): the store does that for every
    result before its ack, whatever the ingest design."""
    from aggregator.storage.blob_files import BlobFiles

    files = BlobFiles(Path(directory) / "probe", durable=True)
    t0 = time.perf_counter()
    for seq in range(1, repeats + 1):
        files.write(seq, data)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=20)
    ap.add_argument("--d", type=int, default=1280)
    ap.add_argument("--ingest-workers", type=int, nargs="+", default=[2],
                    help="worker processes; several values: one aggregator run each, the same raw baseline")
    ap.add_argument("--shards", type=int, nargs="*", default=[1, 2, 4],
                    help="then one run per value with that many shard processes (aggregator serve --shards K)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every configuration this many times, interleaved, and print each one's median "
                         "ratio to the CPU floor (one run swings by tens of percent on a shared machine)")
    args = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    handler = PrecomputedStats(args.d, C)
    print(f"devices={args.devices} d={args.d}")
    raw = None
    runs = [(False, w, 0) for w in args.ingest_workers] + [(True, args.ingest_workers[-1], 0)]
    runs += [(False, 0, k) for k in args.shards]
    floor_ratios: dict[tuple, list[float]] = {}
    for provisional, workers, shards in runs * max(1, args.repeats):
        with MosquittoBroker() as broker, tempfile.TemporaryDirectory() as tmp:
            ids = [f"dev{i:04d}" for i in range(args.devices)]
            ready, out = ctx.Event(), ctx.Queue()
            agg = ctx.Process(target=run_aggregator, args=(broker.url, tmp, ids, args.d, provisional, workers,
                                                           ready, out, shards))
            agg.start()
            ready.wait(300)
            devices = Devices(broker.port, ids, handler)
            devices.all_tasks.wait(300)
            messages = devices.results()
            if shards:
                time.sleep(1.0)     # each shard subscribes to its devices' outboxes when it sees their presence
            total = sum(len(p) for _, p in messages)
            pub = publisher(broker.port)
            if raw is None:         # the broker's rate for exactly these payloads, once
                sub_ready, sub_out = ctx.Event(), ctx.Queue()
                sub = ctx.Process(target=count_bytes, args=(broker.port, total, sub_ready, sub_out))
                sub.start()
                sub_ready.wait(60)
                busy0 = busy_cpu_s()
                t0 = burst(pub, [(f"raw/{i % 50}", p) for i, (_, p) in enumerate(messages)])
                raw_wall = sub_out.get(timeout=600) - t0
                raw_cpu = None if busy0 is None else busy_cpu_s() - busy0
                raw = total / raw_wall
                sub.join()
                print(f"payload per device={total / args.devices / 1e6:.2f} MB")
                print(f"raw broker throughput (same chunked payloads, counting subscriber): {raw / 1e6:8.1f} MB/s",
                      flush=True)
                # What no ingest design avoids: the raw path's CPU (the broker, the publisher, a
                # subscriber receiving every byte) and each result's validation, on this machine's
                # cores; and each result's durable write, on its disk.
                cores, check = os.cpu_count() or 1, validation_cpu_s(devices.whole, args.d)
                window, durable = raw_wall / args.devices, durable_write_s(devices.whole, tmp)
                print(f"per device: the raw broker moves one in {window * 1e3:.1f} ms; validating it costs "
                      f"{check * 1e3:.1f} ms of CPU; writing it durably as the store does {durable * 1e3:.1f} ms "
                      f"-> the disk alone caps the ratio at {min(1.0, window / durable):.2f}", flush=True)
                floor = None
                if raw_cpu is not None:
                    floor = raw_cpu + args.devices * check
                    print(f"CPU: the raw run used {raw_cpu:.2f} CPU-s in {raw_wall:.2f} s; the aggregator run needs at "
                          f"least that plus {args.devices} validations = {floor:.2f} CPU-s, at least "
                          f"{floor / cores:.2f} s on {cores} cores -> the CPU alone caps the ratio at "
                          f"{min(1.0, raw_wall * cores / floor):.2f}", flush=True)
            busy0 = busy_cpu_s()
            t0 = burst(pub, messages)
            t_done, bytes_in, accepted, commit_s = out.get(timeout=900)
            cpu = None if busy0 is None else busy_cpu_s() - busy0
            used = "" if cpu is None else f", {cpu:.2f} CPU-s used, {cpu / args.devices * 1e3:.0f} CPU-ms per result"
            if cpu is not None and floor:
                used += f", {cpu / floor:.2f}x the CPU floor (goal <= 1.2x)"
                floor_ratios.setdefault((provisional, workers, shards), []).append(cpu / floor)
            rate = total / (t_done - t0)
            what = "store+validate+sum+solve+evaluate each" if provisional else "store+validate+sum, solve at the end "
            how = f"{shards} shard processes" if shards else f"{workers} ingest workers"
            print(f"aggregator ingest ({what}), {how}: {rate / 1e6:8.1f} MB/s  "
                  f"ratio to raw {rate / raw:.2f}"
                  f"  (accepted={accepted}, {t_done - t0:.2f} s{used}, {commit_s:.2f} s in store writes: SQLite + "
                  f"payload files)", flush=True)
            agg.join(60)
            pub.loop_stop()
            devices.close()
    if args.repeats > 1:
        for (provisional, workers, shards), ratios in floor_ratios.items():
            how = f"{shards} shard processes" if shards else f"{workers} ingest workers"
            what = ", solve+evaluate each" if provisional else ""
            print(f"{how}{what}: median {statistics.median(ratios):.2f}x the CPU floor over {len(ratios)} runs "
                  f"({', '.join(f'{r:.2f}' for r in ratios)}; goal <= 1.2x)")


if __name__ == "__main__":
    main()
