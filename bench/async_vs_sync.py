"""Asynchronous (FedBuff, ``fedavg-async``) vs synchronous FedAvg(ψ) on the emulated fleet.

Each job runs on a fresh ``EmulatedFleet`` (mosquitto, worker processes hosting the devices, an
aggregator process) with the same heterogeneous profiles: compute slowdowns
drawn log-uniform in ``--slowdown``, uplinks capped, and a per-task drop-out probability (a
dropped device goes offline for a few seconds). Synchronous rounds of κ devices wait for their
slowest member (or its drop-out); the asynchronous job keeps κ devices busy and steps every K
arrivals with staleness weight 1/√(1+τ), so it never waits.

Both jobs train the same head from the same seeded random init, same local recipe; the sync job
runs ``--rounds`` rounds of κ, the async job ``rounds·κ/K`` server steps (the same number of device
updates). Read from each job's evaluation history (the aggregator's wall clock since its first
task, bytes in + out on the wire): the wall time and bytes to first reach the target accuracy,
the lower of the two jobs' best accuracies (so both reach it), and their ratios.

Usage: nice -n 10 .venv/bin/python bench/async_vs_sync.py [--devices 12] [--rounds 8]
Writes runs/bench/async_vs_sync.{json,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedfleet.plots import plot_lines  # noqa: E402
from fedfleet.sim_config import PRESETS  # noqa: E402
from fedfleet.simulate import EmulatedFleet, prepare  # noqa: E402

OUT_DIR = REPO / "runs" / "bench"


def first_reaching(history: list[dict], target: float) -> dict | None:
    for entry in history:
        if entry.get("accuracy") is not None and entry["accuracy"] >= target:
            return entry
    return None


def since_first_task(results: dict) -> dict:
    """The evaluation times counted from the first task sent, not from the job's creation (which
    includes waiting for the fleet's worker processes to come online)."""
    rounds = results["rounds"]
    started_at = rounds[0]["closed_at"] - rounds[0]["t"]
    shift = min(r["opened_at"] for r in rounds) - started_at
    for e in results["history"]:
        e["t"] -= shift
    return results


def curve(history: list[dict], x: str) -> tuple[list[float], list[float]]:
    points = [(e["t"] if x == "t" else (e["bytes_in"] + e["bytes_out"]) / 1e6, e["accuracy"])
              for e in history if e.get("accuracy") is not None]
    return [p[0] for p in points], [p[1] for p in points]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=12)
    ap.add_argument("--train-limit", type=int, default=1000, help="training images shared by the devices")
    ap.add_argument("--clients-per-round", type=int, default=4, help="κ: sync round size = async concurrency")
    ap.add_argument("--buffer-size", type=int, default=2, help="K: async updates per server step")
    ap.add_argument("--max-staleness", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=8, help="sync rounds (async: rounds·κ/K server steps)")
    ap.add_argument("--slowdown", type=float, nargs=2, default=(1.0, 8.0))
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--client-lr", type=float, default=0.05)
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "features"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cfg = dataclasses.replace(PRESETS["smoke"], devices=args.devices, train_limit=args.train_limit, clients_per_round=args.clients_per_round,
                              slowdown=tuple(args.slowdown), dropout_prob=args.dropout, holdout_fraction=0.0,
                              cache_dir=args.cache_dir, out_dir=str(OUT_DIR / "async_vs_sync_run"), seed=args.seed,
                              round_timeout_s=60.0, evaluate="round")
    prep = prepare(cfg, lambda *a: print(*a, flush=True))
    common = {k: prep.fed3r_job[k] for k in ("num_classes", "backbone", "image_size", "weights_sha256", "feature_dim")}
    recipe = {**common, "clients_per_round": cfg.clients_per_round, "round_timeout_s": cfg.round_timeout_s,
              "client_lr": args.client_lr, "local_epochs": 1, "batch_size": 32, "init": "random", "seed": args.seed,
              "expected_devices": cfg.devices, "start_timeout_s": 60.0}
    steps = max(1, round(args.rounds * cfg.clients_per_round / args.buffer_size))
    jobs = {"sync FedAvg": ("fedavg", {**recipe, "job_id": "sync", "rounds": args.rounds}),
            "async FedBuff": ("fedavg-async", {**recipe, "job_id": "async", "rounds": steps,
                                                "buffer_size": args.buffer_size,
                                                "max_staleness": args.max_staleness})}
    results = {}
    t0 = time.monotonic()
    for label, (kind, job) in jobs.items():
        print(f"running {label} ({kind}) on a fresh fleet ...", flush=True)
        # no feature cache on the devices: each task runs the backbone on the device's images, the
        # compute a device's slowdown stretches (a disk cache would make every task near-instant)
        with EmulatedFleet(dataclasses.replace(cfg, cache_dir=None), prep.out, prep.profiles, None,
                           quiet=True) as fleet:
            results[label] = since_first_task(fleet.run_job(kind, job, prep.out / job["job_id"],
                                                            prep.out / "eval_features.npz",
                                                            args.rounds * cfg.clients_per_round))
    wall = time.monotonic() - t0
    best = {label: max(e["accuracy"] for e in r["history"] if e.get("accuracy") is not None)
            for label, r in results.items()}
    target = min(best.values())
    reached = {label: first_reaching(r["history"], target) for label, r in results.items()}
    rows = {label: {"best_accuracy": best[label], "t_to_target_s": e["t"],
                    "mb_to_target": (e["bytes_in"] + e["bytes_out"]) / 1e6,
                    "updates_to_target": e["contributions"], "total_t_s": r["history"][-1]["t"],
                    "stale_dropped": r["history"][-1].get("stale_dropped"),
                    "late": r.get("late"), "dropped": sum(len(x.get("dropped", [])) for x in r.get("rounds", []))}
            for label, r in results.items() for e in [reached[label]]}
    s, a = rows["sync FedAvg"], rows["async FedBuff"]
    report = {"config": {**vars(args), "steps_async": steps}, "target_accuracy": target, "runs": rows,
              "ratios_sync_over_async": {"time": s["t_to_target_s"] / a["t_to_target_s"],
                                         "bytes": s["mb_to_target"] / a["mb_to_target"]},
              "bench_wall_s": wall}
    print(f"\ntarget accuracy {target:.4f} (the lower of the two best accuracies)")
    for label, row in rows.items():
        print(f"{label:14s} best {row['best_accuracy']:.4f}  reached target after {row['t_to_target_s']:6.1f}s, "
              f"{row['mb_to_target']:6.2f} MB, {row['updates_to_target']} updates (job ran {row['total_t_s']:.1f}s)")
    print(f"sync/async: time ×{report['ratios_sync_over_async']['time']:.2f}, "
          f"bytes ×{report['ratios_sync_over_async']['bytes']:.2f}   (bench wall {wall:.0f}s)")
    panels = [{"title": "accuracy vs wall time", "xlabel": "seconds since the first task", "ylabel": "test accuracy",
               "lines": {label: curve(r["history"], "t") for label, r in results.items()}},
              {"title": "accuracy vs bytes on the wire", "xlabel": "MB (in + out)", "ylabel": "test accuracy",
               "lines": {label: curve(r["history"], "mb") for label, r in results.items()}}]
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    engine = plot_lines(OUT_DIR / "async_vs_sync.png", panels)
    (OUT_DIR / "async_vs_sync.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {OUT_DIR / 'async_vs_sync.png'} ({engine}) and async_vs_sync.json")


if __name__ == "__main__":
    main()
