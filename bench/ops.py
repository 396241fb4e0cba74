"""Cost of durability at the aggregator, and how fast a restarted aggregator resumes its job.

One run prints:
1. ingest: K validated Fed3R results of dimension d fed straight into the service's inbound
   path (decode, signature-free validation, round machine, sum; no broker, no per-contribution
   solve, so what differs is only the store) - without a store, with the store at
   ``synchronous=NORMAL`` and at ``synchronous=FULL`` (the default: each contribution is on disk
   before its ack). Rates in contributions/s and MB/s, and the ratios durable / plain.
2. restart-to-resume: (a) in process, building the service on the state file of (1): from the
   round-close checkpoint (a crash between rounds), and by replaying all K stored contributions
   (the worst case: a crash just before a K-device round closes, or checkpoints off); (b) a fresh
   ``python -m aggregator serve --state`` process from exec to "job restored" (interpreter +
   imports + restore), timed with the ``restored`` crash point, which kills the process there.

    .venv/bin/python bench/ops.py [--devices 64] [--d 512] [--repeats 3]
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

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob  # noqa: E402
from aggregator.service.loop import AggregatorService  # noqa: E402
from aggregator.service.settings import ServiceSettings  # noqa: E402
from aggregator.storage.store import Store  # noqa: E402
from fedfleet.emulation.broker import MosquittoBroker  # noqa: E402
from protocols import messages as M  # noqa: E402
from protocols.envelope import encode  # noqa: E402
from protocols.mqtt_link import BrokerConfig  # noqa: E402
from protocols.topics import Topics  # noqa: E402

C = 10
T = Topics()
REPO = Path(__file__).resolve().parents[1]


def config(devices: list[str], d: int) -> dict:
    return {"job_id": "bench", "num_classes": C, "feature_dim": d, "clients_per_round": len(devices),
            "expected_devices": len(devices), "round_timeout_s": 3600, "max_attempts": 1}


def service(devices, d, out: Path, store: Store | None, checkpoints: bool = True) -> AggregatorService:
    # BrokerConfig(port=1): the link is never started; acks are queued in paho and dropped.
    return AggregatorService(Fed3RJob(Fed3RConfig(**config(devices, d))), BrokerConfig(port=1), out,
                             ServiceSettings(evaluate_every_contribution=False, checkpoints=checkpoints),
                             enrolled=set(devices), store=store)


def ingest(devices, d, workdir: Path, synchronous: str | None) -> tuple[float, int]:
    """Seconds to take in every device's result (round opened beforehand), and bytes in."""
    store = Store(workdir / "state.db", synchronous=synchronous) if synchronous else None
    svc = service(devices, d, workdir / "out", store)
    for dev in devices:
        svc._on_payload(T.presence(dev), encode(M.presence_message(dev, "online")))
    svc._tick(time.monotonic())
    tasks = svc.active.rounds[1].tasks
    stats = PrecomputedStats(d, C)
    body, tensors = stats({})
    payloads = [(dev, encode(M.result_message(dev, M.TaskRef("bench", 1, tasks[dev]), "fed3r.stats", body, tensors)))
                for dev in devices]
    t0 = time.perf_counter()
    for dev, payload in payloads:
        svc._on_payload(T.outbox(dev), payload)
    elapsed = time.perf_counter() - t0
    assert svc.job.contributions == len(devices)
    if store is not None:
        store.close()
    return elapsed, sum(len(p) for _, p in payloads)


def restore_in_process(devices, d, workdir: Path, checkpoints: bool) -> float:
    t0 = time.perf_counter()
    svc = service(devices, d, workdir / "out2", Store(workdir / "state.db"), checkpoints)
    elapsed = time.perf_counter() - t0
    assert svc.job.contributions == len(devices)
    return elapsed


def restore_subprocess(devices, d, workdir: Path) -> float:
    (workdir / "job.json").write_text(json.dumps(config(devices, d)))
    (workdir / "enrolled.txt").write_text("\n".join(devices) + "\n")
    env = dict(os.environ, FEDFLEET_CRASH_AT="restored", PYTHONPATH=str(REPO))
    # `aggregator serve` reaches its broker before it restores the job (a broker it cannot reach is
    # refused up front), so the restart is timed against a real one that nobody else uses
    with MosquittoBroker() as broker:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "aggregator", "serve", "--config", str(workdir / "job.json"),
                               "--broker", broker.url, "--out", str(workdir / "out3"), "--state",
                               str(workdir / "state.db"), "--enrolled", str(workdir / "enrolled.txt")],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        elapsed = time.perf_counter() - t0
    if proc.returncode != -9 or "job bench restored" not in proc.stderr:
        raise RuntimeError(f"the restarted aggregator did not reach 'restored':\n{proc.stderr[-2000:]}")
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--d", type=int, default=512, help="feature dimension (payload ~ 4 (d+1)^2 bytes)")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs per variant")
    args = p.parse_args()
    devices = [f"dev{i:04d}" for i in range(args.devices)]
    results: dict[str, float] = {}
    nbytes = 0
    with tempfile.TemporaryDirectory(prefix="fedfleet-bench-ops-") as tmp:
        for name, sync in (("no store", None), ("store NORMAL", "NORMAL"), ("store FULL", "FULL")):
            best = float("inf")
            for r in range(args.repeats):
                work = Path(tmp) / f"{name.replace(' ', '_')}{r}"
                work.mkdir()
                elapsed, nbytes = ingest(devices, args.d, work, sync)
                best = min(best, elapsed)
            results[name] = best
        last_full = Path(tmp) / f"store_FULL{args.repeats - 1}"
        db_bytes = sum(f.stat().st_size for f in last_full.glob("state.db*"))
        from_checkpoint = min(restore_in_process(devices, args.d, last_full, True) for _ in range(args.repeats))
        replay = min(restore_in_process(devices, args.d, last_full, False) for _ in range(args.repeats))
        cold = restore_subprocess(devices, args.d, last_full)

    print(f"fedfleet bench/ops: {args.devices} Fed3R results, d={args.d}, "
          f"{nbytes / args.devices / 1e6:.2f} MB each, best of {args.repeats}")
    print("1. ingest (decode + validate + round machine + sum [+ durable commit])")
    for name, secs in results.items():
        print(f"   {name:<13} {args.devices / secs:8.1f} contributions/s  {nbytes / secs / 1e6:8.1f} MB/s")
    plain = results["no store"]
    print(f"   durable FULL / no store time ratio   {results['store FULL'] / plain:.2f}x")
    print(f"   durable NORMAL / no store time ratio {results['store NORMAL'] / plain:.2f}x")
    print(f"   state file: {db_bytes / 1e6:.1f} MB ({db_bytes / args.devices / 1e6:.2f} MB per contribution)")
    print("2. restart-to-resume")
    print(f"   in process, from the round checkpoint:  {from_checkpoint:.3f} s")
    print(f"   in process, replay {args.devices} contributions:  {replay:.3f} s "
          f"({replay / args.devices * 1e3:.1f} ms per contribution)")
    print(f"   new process, exec -> job restored:      {cold:.2f} s (from the checkpoint)")


if __name__ == "__main__":
    main()
