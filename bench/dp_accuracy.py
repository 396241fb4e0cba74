"""Test accuracy vs ε (δ = 1e-5) of DP Fed3R and DP FedAvg(ψ) on Fashion-MNIST features.

For each ε in {0.5, 1, 2, 4, 8} (and ∞: the same job without DP) the noise multiplier is the
smallest z for which dp-accounting's ε stays within the target (``noise_multiplier_for``):
Fed3R is one Gaussian release whatever its rounds; FedAvg(ψ) is T rounds of the Poisson-sampled
Gaussian at q = κ/K. Two noise placements:

- central: the plain jobs (``fed3r``, ``fedavg``) with the aggregator's noise;
- secagg: the secure jobs (``fed3r-sync``, ``fedavg-secure``) with the devices' Skellam shares,
  each round a real SecAgg round (``protocols.secagg.driver.run_round``, in-process, no MQTT) over
  the real device handlers (``SecureFed3R``, ``SecureFedAvgTraining``); noise is calibrated to
  the SecAgg threshold t = ⌈2κ/3⌉, so with no dropouts the sum carries κ/t times the variance.

Fleets: "demo" — the demo's 100 devices, Dirichlet α = 0.1 (κ = 10), over a seeded subset of
6,000 training images; "cross-device" (``--fleets demo cross-device``) — the same images, one per
device (K = 6,000, κ = 600), central noise only, which shows how the cost of DP falls with the
number of devices.
Features: MobileNetV2 at 32 px, computed once (eager) and cached in .cache/features; a device's
extractor returns its rows. Fixed choices (not tuned on the test set): Fed3R clips feature rows
to F = 8 (about the median norm), caps N = 100 samples per device (1 for cross-device), and sets
λ = max(0.01, 2σ√(Rp)) (the noise matrix's spectral norm, R rounds); FedAvg(ψ) clips updates to
C = 1, T = 30 rounds (10 for cross-device), client LR 0.1, 1 local epoch, random init.

Each row takes one to three minutes on two shared cores (the demo fleet: about 40 minutes).

Usage: nice -n 10 .venv/bin/python bench/dp_accuracy.py [--quick] [--fleets demo cross-device]
       [--methods fed3r fedavg] [--modes central secagg] [--plot-only]
Writes runs/bench/dp_accuracy-<part>.json per part, and runs/bench/dp_accuracy.{json,png} over all parts.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob  # noqa: E402
from aggregator.jobs.registry import build_job  # noqa: E402
from aggregator.jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob  # noqa: E402
from aggregator.compute.privacy import noise_multiplier_for  # noqa: E402
from aggregator.strategies.dp_fed3r import fed3r_sensitivity  # noqa: E402
from edge_client.data.idx import load_fashion_mnist  # noqa: E402
from edge_client.features import FeatureExtractor  # noqa: E402
from edge_client.sample_windows import SampleWindowLedger  # noqa: E402
from edge_client.tasks.fed3r_stats import Fed3RStatsTask  # noqa: E402
from edge_client.tasks.head_training import HeadTrainingTask  # noqa: E402
from edge_client.tasks.secure_fed3r import SecureFed3R  # noqa: E402
from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining  # noqa: E402
from fedfleet.emulation.partition import make_split  # noqa: E402
from fedfleet.plots import plot_lines  # noqa: E402
from protocols import messages as M  # noqa: E402
from protocols.envelope import decode, encode  # noqa: E402
from protocols.identity import DeviceIdentity, IdentityRegistry  # noqa: E402
from protocols.rounds import RoundClosed  # noqa: E402
from protocols.secagg import AggregateReady  # noqa: E402
from protocols.secagg.driver import run_round  # noqa: E402

OUT_DIR = REPO / "runs" / "bench"
EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0)
DELTA = 1e-5
D, C_CLASSES = 1280, 10
FLEETS = {"demo": {"devices": 100, "split": ("dirichlet", {"alpha": 0.1}), "kappa": 10, "max_samples": 100,
                   "fedavg_rounds": 30},
          "cross-device": {"devices": 6000, "split": ("iid", {}), "kappa": 600, "max_samples": 1, "fedavg_rounds": 10}}
FEATURE_CLIP, UPDATE_CLIP = 8.0, 1.0


class CachedRows:
    """A device's extractor: its 'images' are already its rows of the cached feature matrix."""

    feature_dim = D

    def extract(self, rows):
        return np.asarray(rows, dtype=np.float32)


def load_features(n_train: int, n_test: int, also=None):
    """[(train features, labels), (test ...)] of seeded Fashion-MNIST subsets (MobileNetV2, 32 px,
    cached); with ``also`` (images -> images) each tuple adds the features of ``also(images)``."""
    extractor = FeatureExtractor.eager("mobilenet_v2", image_size=32, batch_size=256,
                                       cache_dir=REPO / ".cache" / "features", threads=2)
    out = []
    for split, n, seed in (("train", n_train, 0), ("test", n_test, 1)):
        images, labels = load_fashion_mnist(split)
        idx = np.sort(np.random.default_rng(seed).choice(len(images), n, replace=False))
        t0 = time.perf_counter()
        row = (extractor.extract(images[idx]), labels[idx].astype(np.int64))
        out.append(row + ((extractor.extract(also(images[idx])),) if also is not None else ()))
        print(f"features {split}: {out[-1][0].shape} in {time.perf_counter() - t0:.1f}s", flush=True)
    return out


def roundtrip(job, device, kind, body, tensors):
    """The device's result as the aggregator receives it: encoded, decoded, validated."""
    msg = M.result_message(device, M.TaskRef(job.config.job_id, job.round, "x" * 32), kind, body, tensors)
    return job.parse_result(decode(encode(msg)))


def secure_round(job, chosen, identities, agg, handlers, seed):
    """One real SecAgg round in-process; the job gets the unmasked (noisy) sum."""
    vectors = {}
    for i, d in enumerate(chosen):
        params, tensors = job.task_for(d)
        handler = handlers(d, np.random.default_rng(seed * 100_000 + i))
        vectors[d] = handler.vector(params, tensors)
    run = run_round(job.secure.config, agg, {d: identities[d] for d in chosen}, vectors)
    assert isinstance(run.outcome, AggregateReady), run.outcome
    job.on_secure_sum(run.outcome.decode(), tuple(sorted(run.outcome.survivors)))
    job.secure = None                      # the round is over (what the service's routing does)


def drive(job, ids, test, kind, tasks, secure, seed):
    """Every round of a job until it is done; the test accuracy of its final model. ``secure``:
    (device identities, aggregator identity, handler factory) for SecAgg rounds, else falsy."""
    while chosen := job.next_participants(set(ids)):
        if secure:
            secure_round(job, chosen, *secure, seed + job.round)
        else:
            for d in chosen:
                params, tensors = job.task_for(d)
                job.apply(d, roundtrip(job, d, kind, *tasks[d](params, tensors)))
        job.close_round(RoundClosed(job.round, tuple(chosen), (), (), ()))
    return job.evaluate(*test)["accuracy"]


def fed3r_config(fleet, z, secure, rounds):
    f = FLEETS[fleet]
    cfg = {"job_id": "dp-fed3r", "num_classes": C_CLASSES, "feature_dim": D, "clients_per_round": f["kappa"],
           "lam": 0.01, "seed": 0}
    if z:
        sigma = z * fed3r_sensitivity(f["max_samples"], FEATURE_CLIP, True)
        cfg.update(dp_noise_multiplier=z, dp_delta=DELTA, feature_clip_norm=FEATURE_CLIP,
                   max_samples=f["max_samples"], lam=max(0.01, 2 * sigma * math.sqrt(rounds * (D + 1))),
                   dp_mechanism="gaussian")     # the mechanism its table measured (ssp: bench/dp_fleet_scale.py)
    if secure:
        cfg.update(max_samples=f["max_samples"] if z else 10_000, phase_timeout_s=30.0)
    return cfg


def run_fed3r(fleet, devices, test, z, secure, seed):
    ids = sorted(devices)
    rounds = math.ceil(len(ids) / FLEETS[fleet]["kappa"])
    cfg = fed3r_config(fleet, z, secure, rounds)
    # each device keeps its sample windows in a state folder of its own: a DP job caps its samples,
    # which a device without one declines (edge_client/sample_windows.py)
    with tempfile.TemporaryDirectory(prefix="dp-accuracy-windows-") as state:
        tasks = {d: Fed3RStatsTask(*devices[d], lambda b, s, w: CachedRows(),
                                   windows=SampleWindowLedger(pathlib.Path(state) / f"{d}.json")) for d in ids}
        if secure:
            job, parts = secure_job(ids, tasks, lambda **keys: Fed3RSyncJob(Fed3RSyncConfig(**cfg), **keys),
                                    SecureFed3R)
        else:
            job, parts = build_job("fed3r", cfg), None
            if z:
                job.strategy.rng = np.random.default_rng(seed)
        return drive(job, ids, test, "fed3r.stats", tasks, parts, seed)


def run_fedavg(fleet, devices, test, z, secure, seed):
    f = FLEETS[fleet]
    ids = sorted(devices)
    cfg = {"job_id": "dp-fedavg", "num_classes": C_CLASSES, "feature_dim": D, "rounds": f["fedavg_rounds"],
           "clients_per_round": f["kappa"], "local_epochs": 1, "batch_size": 16, "client_lr": 0.1, "seed": seed}
    if z:
        cfg.update(dp_noise_multiplier=z, dp_delta=DELTA, dp_clip_norm=UPDATE_CLIP,
                   **({} if secure else {"dp_population": len(ids)}))
    tasks = {d: HeadTrainingTask(*devices[d], lambda b, s, w: CachedRows()) for d in ids}
    if secure:
        config = SecureFedAvgConfig(**cfg, max_samples=10_000, phase_timeout_s=30.0)
        job, parts = secure_job(ids, tasks, lambda **keys: SecureFedAvgJob(config, **keys), SecureFedAvgTraining)
    else:
        job, parts = build_job("fedavg", cfg), None
        if z:
            job.dp.rng = np.random.default_rng(seed)
    return drive(job, ids, test, "fedavg.head", tasks, parts, seed)


def secure_job(ids, tasks, make_job, handler_cls):
    """A secure job with fresh identities and the device handler factory its rounds need."""
    identities = {d: DeviceIdentity.generate(d) for d in ids}
    agg = DeviceIdentity.generate("aggregator")
    job = make_job(identity=agg, registry=IdentityRegistry({d: i.public_key_bytes for d, i in identities.items()}))
    handlers = lambda d, rng: handler_cls(identities[d], agg.public_key_bytes, tasks[d], noise_rng=rng)  # noqa: E731
    return job, (identities, agg, handlers)


def noise_for(method, fleet, eps, secure=False):
    """The smallest z for ε; secure FedAvg claims no amplification by sampling (the aggregator draws
    the sample, and distributed DP guards against it: its config refuses dp_population)."""
    f = FLEETS[fleet]
    if eps is None:
        return 0.0
    if method == "fed3r":
        return noise_multiplier_for(eps, DELTA, 1)
    return noise_multiplier_for(eps, DELTA, f["fedavg_rounds"], 1.0 if secure else f["kappa"] / f["devices"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="ε ∈ {1, 8} and the demo fleet only")
    ap.add_argument("--fleets", nargs="+", default=["demo"], choices=list(FLEETS))
    ap.add_argument("--methods", nargs="+", default=["fed3r", "fedavg"], choices=["fed3r", "fedavg"])
    ap.add_argument("--modes", nargs="+", default=["central", "secagg"], choices=["central", "secagg"])
    ap.add_argument("--plot-only", action="store_true", help="merge the parts' JSON files into the figure")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    epsilons = (1.0, 8.0) if args.quick else EPSILONS
    fleets = ["demo"] if args.quick else args.fleets
    if not args.plot_only:
        run_part(fleets, args.methods, args.modes, epsilons, args.seed)
    results = [row for part in sorted(OUT_DIR.glob("dp_accuracy-*.json")) for row in json.loads(part.read_text())]
    (OUT_DIR / "dp_accuracy.json").write_text(json.dumps(results, indent=1))
    print(plot_lines(OUT_DIR / "dp_accuracy.png", figure_panels(results)))


def run_part(fleets, methods, modes, epsilons, seed) -> None:
    """Rows of these fleets × methods × modes; written after every row to their own part file
    (parts can run as parallel processes; ``--plot-only`` merges them)."""
    (Xtr, ytr), test = load_features(6000, 2000)
    runs = {"fed3r": run_fed3r, "fedavg": run_fedavg}
    out = OUT_DIR / f"dp_accuracy-{'+'.join(fleets)}-{'+'.join(methods)}-{'+'.join(modes)}.json"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    results = []
    for fleet in fleets:
        f = FLEETS[fleet]
        parts = make_split(f["split"][0], ytr, f["devices"], seed, **f["split"][1])
        devices = {f"dev{i:04d}": (Xtr[idx], ytr[idx]) for i, idx in enumerate(parts) if len(idx)}
        for method in methods:
            for mode in modes if fleet == "demo" else ("central",):
                for eps in (None, *epsilons):
                    z = noise_for(method, fleet, eps, mode == "secagg")
                    t0 = time.perf_counter()
                    acc = runs[method](fleet, devices, test, z, mode == "secagg", seed)
                    row = {"fleet": fleet, "method": method, "mode": mode, "epsilon": eps, "delta": DELTA,
                           "noise_multiplier": z, "accuracy": acc, "seconds": time.perf_counter() - t0}
                    results.append(row)
                    print(json.dumps(row), flush=True)
                    out.write_text(json.dumps(results, indent=1))


def figure_panels(results: list[dict]) -> list[dict]:
    panels = []
    for fleet in sorted({r["fleet"] for r in results}, key=list(FLEETS).index):
        lines = {}
        for method in ("fed3r", "fedavg"):
            for mode in ("central", "secagg"):
                rows = [r for r in results if (r["fleet"], r["method"], r["mode"]) == (fleet, method, mode)]
                private = sorted((r for r in rows if r["epsilon"] is not None), key=lambda r: r["epsilon"])
                if private:
                    lines[f"{method} {mode}"] = ([r["epsilon"] for r in private], [r["accuracy"] for r in private])
                plain = [r["accuracy"] for r in rows if r["epsilon"] is None]
                if plain and mode == "central":
                    lines[f"{method} no DP"] = ([EPSILONS[0], EPSILONS[-1]], [plain[0], plain[0]])
        styles = {label: {"linestyle": "--", "linewidth": 1.5, "color": "C0" if label.startswith("fed3r") else "C1"}
                  for label in lines if label.endswith("no DP")}
        styles.update({label: {"marker": "o", "color": "C0" if label.startswith("fed3r") else "C1",
                               "linestyle": "-" if label.endswith("central") else ":"}
                       for label in lines if not label.endswith("no DP")})
        panels.append({"title": f"{fleet}: test accuracy vs ε (δ = {DELTA:g})", "xlabel": "ε (log scale)",
                       "ylabel": "test accuracy", "lines": lines, "logx": True, "xticks": list(EPSILONS),
                       "ylim": (0.0, 1.0), "percent": True, "styles": styles})
    return panels


if __name__ == "__main__":
    main()
