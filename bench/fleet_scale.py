"""(c) Emulated devices per second, memory per idle device and contributions per second, at
1,000, 10,000 and (with ``--large``) 100,000 devices in one run, side by side.

For each size: a private broker tree (``fedfleet.emulation.broker.BrokerTree``: one mosquitto up
to ``--per-broker`` devices, else a core and bridged edge mosquittos), the aggregator as its own
process (``python -m aggregator serve``, a Fed3R job asking every device at once) and host
processes of at most ``--per-host`` devices each (this script with ``--host``): real
edge_client DeviceAgents on one :class:`fedfleet.emulation.host.DeviceHost` each (own MQTT
connection, client id, session and last will; one MQTT event loop, no thread per device). A
process opens at most RLIMIT_NOFILE sockets (20,000 here, not raisable unprivileged), hence
several hosts and brokers past that. Each device's handler returns precomputed Fed3R statistics
through the host's compute slot, so the bench measures hosting and transport, not the backbone.
Prints: devices started per second (first host starting to every device connected), RSS per
idle device (the hosts' RSS growth / N) and contributions per second end to end (first device
started to the aggregator's final model).

    .venv/bin/python bench/fleet_scale.py [--sizes 1000,10000] [--large] [--d 64]

Measured before this layout (one in-process host, one broker, shared 2-core machine): 1,000
devices: 901 started/s, 24 KiB per idle device, 123 contributions/s; 10,000 devices: 370
started/s, 21 KiB, 104/s. With it (``--sizes 30000 --connect-only --per-host 10000``, loaded
machine): 30,000 devices, 3 hosts, 2 edge brokers: 1,864 started/s, 24 KiB per idle device.
``--large`` at stop 32 (idle 2-core machine), 1,000 / 10,000 / 100,000 devices: 1,666 / 1,423 /
1,779 started/s, 25 / 26 / 24 KiB per idle device, 355 / 563 / 418 contributions/s, every device
contributing (100,000 in 239 s; before MqttLink's MAX_UNACKED window the round of 100,000 stalled
after 72,662 results: the aggregator's 100,000 task publishes outran paho's 16-bit message ids).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _synthetic import PrecomputedStats  # noqa: E402

from edge_client.agent import AgentHooks, DeviceAgent  # noqa: E402
from fedfleet.emulation.broker import BrokerTree, broker_for, loopback_sources  # noqa: E402
from fedfleet.emulation.host import DeviceHost, LazyTasks, rss_mb  # noqa: E402
from protocols.mqtt_eventloop import raise_open_file_limit  # noqa: E402
from protocols.mqtt_link import BrokerConfig  # noqa: E402
from protocols.topics import Topics  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def start_aggregator(url: str, work: Path, ids: list[str], d: int) -> subprocess.Popen:
    job = {"job_id": "scale", "num_classes": 10, "feature_dim": d, "clients_per_round": len(ids),
           "expected_devices": len(ids), "round_timeout_s": max(900, len(ids) // 20), "start_timeout_s": 900,
           "max_attempts": 1}
    (work / "job.json").write_text(json.dumps(job))
    (work / "enrolled.txt").write_text("\n".join(ids) + "\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "aggregator", "serve", "--config", str(work / "job.json"),
                             "--kind", "fed3r", "--broker", url, "--out", str(work / "out"),
                             "--enrolled", str(work / "enrolled.txt"), "--timeout", "3600"],
                            env=env, stdout=open(work / "aggregator.log", "w"), stderr=subprocess.STDOUT)


def device_ids(n: int) -> list[str]:
    return [f"dev{i:06d}" for i in range(n)]


def run_host(args) -> None:
    """``--host``: devices [first, first + count) of an N-device fleet on one DeviceHost; writes
    when they started and connected and the RSS they added, then idles until SIGTERM."""
    urls, ids = args.brokers.split(","), device_ids(args.fleet)[args.first:args.first + args.count]
    stats = PrecomputedStats(args.d, 10)
    host = DeviceHost(step_threads=8, tick_s=2.0, source_addresses=loopback_sources(args.host_index, args.count))
    m0, t0 = rss_mb(), time.time()
    for i, dev in enumerate(ids, start=args.first):
        tasks = LazyTasks(lambda: {"fed3r.stats": stats}, ["fed3r.stats"], host.compute_slot)
        broker = BrokerConfig.from_url(broker_for(i, urls), keepalive=300)      # as fleet-100k
        host.add(lambda lf, dev=dev, tasks=tasks, broker=broker: DeviceAgent(
            dev, broker, tasks.handlers(), retry_after_s=600, link_factory=lf, hooks=AgentHooks(always_available=True)))
    connected = host.wait_connected(timeout_s=600)
    report = {"started_at": t0, "connected_at": time.time(), "connected": connected, "rss_added_mb": rss_mb() - m0,
              "rss_mb": rss_mb(), "open_file_limit": host.open_file_limit}
    Path(args.out).write_text(json.dumps(report))
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    while not stop[0]:
        time.sleep(0.5)
    report["rss_added_after_work_mb"] = rss_mb() - m0      # every device has handled its ack: idle again
    Path(args.out).write_text(json.dumps(report))
    host.stop()


def start_hosts(n: int, urls: list[str], work: Path, args) -> list[tuple[subprocess.Popen, Path]]:
    hosts = []
    for h, first in enumerate(range(0, n, args.per_host)):
        out = work / f"host{h}.json"
        cmd = [sys.executable, __file__, "--host", "--host-index", str(h), "--fleet", str(n), "--first", str(first),
               "--count", str(min(args.per_host, n - first)), "--brokers", ",".join(urls), "--out", str(out),
               "--d", str(args.d)]
        hosts.append((subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(REPO)),
                                       stdout=open(work / f"host{h}.log", "w"), stderr=subprocess.STDOUT), out))
    return hosts


def wait_for_files(paths: list[Path], timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [json.loads(p.read_text()) for p in paths if p.exists()]


def measure(n: int, args, work: Path) -> dict:
    with BrokerTree.for_devices(n, Topics(), args.per_broker) as tree:
        agg = None if args.connect_only else start_aggregator(tree.url, work, device_ids(n), args.d)
        hosts = start_hosts(n, tree.device_urls, work, args)
        up = wait_for_files([out for _, out in hosts], 900)
        broker_mb = tree.rss_mb()
        rc = agg.wait(timeout=3600) if agg else None
        t_done = time.time()
        time.sleep(0 if agg is None else 4.0)      # every device has handled its ack: idle again
        for proc, out in hosts:
            out.unlink(missing_ok=True)
            proc.send_signal(signal.SIGTERM)
        after = wait_for_files([out for _, out in hosts], 300)
        for proc, _ in hosts:
            proc.wait(timeout=300)
    t0 = min(h["started_at"] for h in up)
    results = json.loads((work / "out" / "results.json").read_text()) if (work / "out" / "results.json").exists() else {}
    contributed = len(results.get("contributed", []))
    return {"devices": n, "hosts": len(hosts), "brokers": len(tree.device_urls),
            "connected": sum(h["connected"] for h in up),
            "started_per_s": n / (max(h["connected_at"] for h in up) - t0),
            "rss_mb_per_device": sum(h["rss_added_mb"] for h in up) / n,
            "rss_mb_per_device_after_work": sum(h["rss_added_after_work_mb"] for h in after) / n,
            "host_rss_mb": sum(h["rss_mb"] for h in up), "broker_rss_mb": broker_mb, "aggregator_exit": rc,
            "contributed": contributed, "contributions_per_s": contributed / (t_done - t0), "wall_s": t_done - t0,
            "open_file_limit": up[0]["open_file_limit"]}


def print_table(rows: list[dict]) -> None:
    """The sizes side by side, one column each."""
    cells = [("devices", lambda r: f"{r['devices']:,}"), ("hosts / brokers", lambda r: f"{r['hosts']} / {r['brokers']}"),
             ("connected", lambda r: f"{r['connected']:,}"),
             ("started per s", lambda r: f"{r['started_per_s']:.0f}"),
             ("RSS per idle device", lambda r: f"{r['rss_mb_per_device'] * 1024:.0f} KiB"),
             ("  after its task", lambda r: f"{r['rss_mb_per_device_after_work'] * 1024:.0f} KiB"),
             ("broker RSS", lambda r: f"{r['broker_rss_mb']:.0f} MB"),
             ("contributions", lambda r: f"{r['contributed']:,}"),
             ("contributions per s", lambda r: f"{r['contributions_per_s']:.0f}"),
             ("wall", lambda r: f"{r['wall_s']:.0f} s")]
    for name, cell in cells:
        print(f"{name:<22}" + "".join(f"{cell(r):>14}" for r in rows), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000", help="fleet sizes, comma-separated")
    ap.add_argument("--large", action="store_true", help="add 100,000 devices (an idle machine: ~10+ minutes)")
    ap.add_argument("--d", type=int, default=64, help="feature dimension of the synthetic statistics")
    ap.add_argument("--per-host", type=int, default=12_500, help="devices per host process")
    ap.add_argument("--per-broker", type=int, default=17_000, help="devices per mosquitto (edges past one)")
    ap.add_argument("--connect-only", action="store_true", help="start and connect the devices, no job")
    ap.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--fleet", "--first", "--count", "--host-index"):
        ap.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--brokers", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    raise_open_file_limit()
    if args.host:
        return run_host(args)
    sizes = sorted({int(s) for s in args.sizes.split(",")} | ({100_000} if args.large else set()))
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(measure(n, args, Path(tmp)))
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
