"""Fed3R vs FedAvg(ψ) vs Fed3R+FT(ψ) on Fashion-MNIST with frozen MobileNetV2 features.

What it measures, in one run (per split × seed, then mean ± std over seeds):

1. Fed3R (κ devices per round, each device once) and FedAvg(ψ) from a random head, tuned
   over client LR {0.1, 0.01} × server momentum {0, 0.9} (server LR 1; the best setting is
   picked per split by mean best test accuracy, which flatters the baseline), plus Fed3R+FT(ψ):
   the same FedAvg grid started from the normalised Fed3R head, client LR × 0.1 (spec rule).
2. Rounds, bytes up/down (encoded envelopes, headers included) and device compute to reach
   (i) FedAvg(ψ)'s best accuracy and (ii) centralized ridge accuracy − 1 point. Compute is
   reported as FLOPs of the head work (Fed3R: 2·n·p² for ZᵀZ; FedAvg(ψ): 6·E·n·d·C per
   participation, forward + backward), the backbone's cost F_φ·n once per participating
   device (features are cached across rounds), and measured handler seconds.
3. Ordering: FedAvg rounds for a Fed3R-initialised head vs a random head to reach the random
   head's best accuracy (the Fed3R rounds are added on top).
4. The paper's byte cost model: Fed3R uploads ½p(p+1) + p·C̄ floats per device once, FedAvg(ψ)
   moves 2·d·C floats per participant per round; break-even round counts for C ∈ {10, 100,
   1000, 2028}.

It runs the real job / strategy / task-handler classes (``Fed3RJob``, ``FedAvgJob``,
``Fed3RStatsTask``, ``HeadTrainingTask``) and the real round machine (``RoundCoordinator``)
in-process, without MQTT: every task and result is encoded and decoded as an envelope (so
the byte counts are real wire sizes), but nothing goes through a broker. No stragglers are
emulated here. Backbone features are computed once with ``FeatureExtractor.eager`` (cached
in .cache/features); each device's extractor then returns its rows of that cache, which is
what the device's own feature cache would do. Local training runs the eager torch path.

Usage: .venv/bin/python bench/fed3r_vs_fedavg.py [--rounds 200] [--seeds 0 1 2] [--quick]
Writes runs/bench/fed3r_vs_fedavg.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob  # noqa: E402
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob  # noqa: E402
from aggregator.compute.ridge import ClosedFormRidge  # noqa: E402
from edge_client.data.idx import load_fashion_mnist  # noqa: E402
from edge_client.features import FeatureExtractor  # noqa: E402
from edge_client.tasks.fed3r_stats import Fed3RStatsTask  # noqa: E402
from edge_client.tasks.head_training import HeadTrainingTask  # noqa: E402
from fedfleet.emulation.partition import make_split  # noqa: E402
from fedfleet.plots import plot_lines  # noqa: E402
from protocols import messages as M  # noqa: E402
from protocols.envelope import decode, encode  # noqa: E402
from protocols.rounds import ApplyResult, ResultArrived, RoundClosed, RoundCoordinator  # noqa: E402

OUT_DIR = REPO / "runs" / "bench"
BACKBONE, IMAGE_SIZE, NUM_CLASSES = "mobilenet_v2", 32, 10
SPLITS = {"2 classes/device": ("classes", {"k": 2}), "Dirichlet 0.1": ("dirichlet", {"alpha": 0.1})}
GRID = [(lr, mom) for lr in (0.1, 0.01) for mom in (0.0, 0.9)]


# ----------------------------------------------------------------------------- data
def load_features(image_size: int = IMAGE_SIZE):
    """Fashion-MNIST train/test images, labels and frozen-backbone features (cached on disk)."""
    extractor = FeatureExtractor.eager(BACKBONE, image_size=image_size, batch_size=256,
                                       cache_dir=REPO / ".cache" / "features", threads=2)
    data = {}
    for split in ("train", "test"):
        images, labels = load_fashion_mnist(split)
        t0 = time.perf_counter()
        feats = extractor.extract(images)
        print(f"features {split}: {feats.shape} in {time.perf_counter() - t0:.1f}s", flush=True)
        data[split] = (images, labels.astype(np.int64), feats)
    return data, extractor


class CachedFeatures:
    """A device's extractor with a warm cache: returns that device's precomputed features."""

    def __init__(self, images: np.ndarray, features: np.ndarray):
        self.images, self.features = images, features
        self.feature_dim = features.shape[1]

    def extract(self, images: np.ndarray) -> np.ndarray:
        """The rows of this device's images (the task handler passes a view: the samples from
        ``from_sample`` on)."""
        if images is self.images:
            return self.features
        if images.base is not self.images:
            raise ValueError("this cached extractor only knows its own device's images")
        start = (images.__array_interface__["data"][0] - self.images.__array_interface__["data"][0]) \
            // self.images.strides[0]
        return self.features[start:start + len(images)]


def backbone_flops_per_image(image_size: int = IMAGE_SIZE) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from edge_client.models import build_backbone

    model = build_backbone(BACKBONE, pretrained=False).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 3, image_size, image_size))
    return float(counter.get_total_flops())


# ----------------------------------------------------------------------------- in-process fleet
@dataclass
class Curve:
    """Per-round accuracy and cumulative costs after each round."""

    accuracy: list[float] = field(default_factory=list)
    bytes_up: list[int] = field(default_factory=list)
    bytes_down: list[int] = field(default_factory=list)
    head_flops: list[float] = field(default_factory=list)
    backbone_flops: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)

    def first_round_reaching(self, target: float) -> int | None:
        hits = [i for i, a in enumerate(self.accuracy) if a >= target - 1e-12]
        return hits[0] + 1 if hits else None

    def at(self, round_: int | None) -> dict:
        if round_ is None:
            return {"rounds": None}
        i = round_ - 1
        return {"rounds": round_, "bytes_up": self.bytes_up[i], "bytes_down": self.bytes_down[i],
                "head_flops": self.head_flops[i], "device_flops": self.head_flops[i] + self.backbone_flops[i],
                "compute_s": self.compute_s[i]}


def run_job(job, handlers: dict, sizes: dict[str, int], eval_set, head_flops_per_task, backbone_flops_per_sample):
    """Drive ``job`` to completion through the round machine; one Curve point per round."""
    curve = Curve()
    up = down = 0
    hflops = bflops = secs = 0.0
    featurised: set[str] = set()
    online = set(handlers)
    while True:
        chosen = job.next_participants(online)
        if not chosen:
            break
        coord = RoundCoordinator(job.round, frozenset(chosen), deadline=math.inf)
        for device in chosen:
            params, tensors = job.task_for(device)
            task = M.task_message("aggregator", job.config.job_id, job.round, job.kind, params, 0.0)
            task.tensors.update(tensors)
            down += len(encode(task))
            t0 = time.perf_counter()
            body, out = handlers[device](params, tensors) if tensors else handlers[device](params)
            secs += time.perf_counter() - t0
            hflops += head_flops_per_task(params, sizes[device])
            if device not in featurised:                  # one backbone pass per device, then cached
                featurised.add(device)
                bflops += backbone_flops_per_sample * sizes[device]
            wire = encode(M.result_message(device, M.TaskRef(job.config.job_id, job.round, task.id), job.kind,
                                           body, out))
            up += len(wire)
            env = decode(wire)
            for act in coord.handle(ResultArrived(device, env.id, job.parse_result(env))):
                if isinstance(act, ApplyResult):
                    job.apply(act.device, act.result)
                elif isinstance(act, RoundClosed):
                    job.close_round(act)
        curve.accuracy.append(job.evaluate(*eval_set)["accuracy"])
        curve.bytes_up.append(up)
        curve.bytes_down.append(down)
        curve.head_flops.append(hflops)
        curve.backbone_flops.append(bflops)
        curve.compute_s.append(secs)
    return curve


@dataclass
class Fleet:
    """One partition of the training set over devices, with both task handlers per device."""

    parts: list[np.ndarray]
    fed3r: dict
    head: dict
    sizes: dict

    @classmethod
    def build(cls, data, parts):
        images, labels, feats = data["train"]
        fed3r, head, sizes = {}, {}, {}
        for k, idx in enumerate(parts):
            dev = f"dev{k:03d}"
            x, y = images[idx], labels[idx]
            factory = (lambda cached: lambda *a: cached)(CachedFeatures(x, feats[idx]))
            fed3r[dev] = Fed3RStatsTask(x, y, factory)
            head[dev] = HeadTrainingTask(x, y, factory)
            sizes[dev] = len(idx)
        return cls(parts, fed3r, head, sizes)


def fed3r_head_flops(p: int):
    return lambda params, n: 2.0 * n * p * p + n * p


def fedavg_head_flops(params, n):
    return 6.0 * params["epochs"] * n * params["feature_dim"] * params["num_classes"]


def run_fed3r(fleet: Fleet, eval_set, seed, kappa, fflops, dtype="float32"):
    cfg = Fed3RConfig(num_classes=NUM_CLASSES, image_size=IMAGE_SIZE, feature_dim=eval_set[0].shape[1],
                      clients_per_round=kappa, stats_dtype=dtype, seed=seed)
    job = Fed3RJob(cfg)
    curve = run_job(job, fleet.fed3r, fleet.sizes, eval_set, fed3r_head_flops(cfg.p), fflops)
    return job, curve


def run_fedavg(fleet: Fleet, eval_set, seed, kappa, rounds, lr, momentum, fflops, init_model=None):
    cfg = FedAvgConfig(num_classes=NUM_CLASSES, image_size=IMAGE_SIZE, feature_dim=eval_set[0].shape[1],
                       rounds=rounds, clients_per_round=kappa, client_lr=lr, server_momentum=momentum, seed=seed)
    job = FedAvgJob.from_fed3r(cfg, init_model) if init_model is not None else FedAvgJob(cfg)
    return job, run_job(job, fleet.head, fleet.sizes, eval_set, fedavg_head_flops, fflops)


# ----------------------------------------------------------------------------- plotting
# ----------------------------------------------------------------------------- reporting
def mean_std(values) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "never"
    s = f"{np.mean(vals):.4g}±{np.std(vals):.2g}"
    return s if len(vals) == len(values) else f"{s} ({len(vals)}/{len(values)} seeds reach)"


def cost_model_table(d: int, K: int, kappa: int, c_bar: float, measured_rounds: dict | None = None) -> list[str]:
    """Paper's accounting (floats ×4 bytes): Fed3R K·(½p(p+1) + p·C̄) vs FedAvg(ψ) R·κ·2·p·C."""
    p = d + 1
    rows = [f"cost model, d={d} (+1 bias), K={K}, κ={kappa}, C̄={c_bar:.2f}: "
            "Fed3R total = K(½p(p+1)+pC̄) floats (upload only, once); FedAvg(ψ) = R·κ·2pC floats"]
    for C in (10, 100, 1000, 2028):
        fed3r = K * (p * (p + 1) / 2 + p * c_bar) * 4
        per_round = kappa * 2 * p * C * 4
        rows.append(f"  C={C:5d}: Fed3R {fed3r / 1e6:8.1f} MB; FedAvg(ψ) {per_round / 1e6:7.2f} MB/round; "
                    f"break-even at R* = {fed3r / per_round:7.1f} rounds")
    if measured_rounds:
        for name, R in measured_rounds.items():
            rows.append(f"  measured here (C=10): FedAvg(ψ) needs {R} rounds for {name} -> FedAvg/Fed3R bytes = "
                        f"{R * kappa * 2 * p * 10 / (K * (p * (p + 1) / 2 + p * c_bar)):.2f}" if R else
                        f"  measured here (C=10): FedAvg(ψ) never reaches {name}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200, help="FedAvg(ψ) rounds per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=1, help="torch threads for local training")
    ap.add_argument("--devices", type=int, default=100)
    ap.add_argument("--kappa", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="1 seed, 30 rounds, 2-config grid (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.rounds = args.seeds[:1], min(args.rounds, 30)
    grid = GRID[:2] if args.quick else GRID
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    data, _ = load_features()
    torch.set_num_threads(args.threads)   # tiny per-step work: more threads only add contention
    fflops = backbone_flops_per_image()
    _, ytr, ftr = data["train"]
    _, yte, fte = data["test"]
    eval_set = (fte, yte)
    ridge = ClosedFormRidge(0.01, device="cpu").fit(ftr, ytr, NUM_CLASSES)
    ridge_acc = ridge.score(fte, yte)
    print(f"centralized ridge (λ=0.01, normalised columns) test accuracy: {ridge_acc:.4f}; "
          f"backbone F_φ = {fflops / 1e6:.1f} MFLOP/image at {IMAGE_SIZE}px\n", flush=True)

    report: dict = {"ridge_accuracy": ridge_acc, "rounds": args.rounds, "seeds": args.seeds, "splits": {}}
    panels = []
    for split_name, (kind, params) in SPLITS.items():
        runs: dict = {"fed3r": [], "fedavg": {cfg: [] for cfg in grid}, "ft": {cfg: [] for cfg in grid}, "c_bar": []}
        for seed in args.seeds:
            t0 = time.perf_counter()
            parts = make_split(kind, ytr, args.devices, seed, **params)
            runs["c_bar"].append(float(np.mean([len(np.unique(ytr[p])) for p in parts])))
            fleet = Fleet.build(data, parts)
            fed3r_job, fed3r_curve = run_fed3r(fleet, eval_set, seed, args.kappa, fflops)
            runs["fed3r"].append(fed3r_curve)
            for lr, mom in grid:
                runs["fedavg"][(lr, mom)].append(
                    run_fedavg(fleet, eval_set, seed, args.kappa, args.rounds, lr, mom, fflops)[1])
                runs["ft"][(lr, mom)].append(
                    run_fedavg(fleet, eval_set, seed, args.kappa, args.rounds, lr, mom, fflops, fed3r_job.model())[1])
            print(f"[{split_name}] seed {seed}: fed3r final {fed3r_curve.accuracy[-1]:.4f}, "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
        report["splits"][split_name] = summarise(split_name, runs, grid, ridge_acc, args)
        best = report["splits"][split_name]["best_fedavg"]
        best_ft = report["splits"][split_name]["best_ft"]
        lines = {"Fed3R": (np.arange(1, len(runs["fed3r"][0].accuracy) + 1), runs["fed3r"][0].accuracy)}
        for cfg in grid:
            lines[f"FedAvg(ψ) lr={cfg[0]} β={cfg[1]}"] = (np.arange(1, args.rounds + 1), runs["fedavg"][cfg][0].accuracy)
        ft = runs["ft"][tuple(best_ft)][0]
        lines[f"Fed3R+FT(ψ) lr={best_ft[0]}×0.1 β={best_ft[1]}"] = (
            np.arange(1, args.rounds + 1) + len(runs["fed3r"][0].accuracy), ft.accuracy)
        panels.append({"title": f"{split_name}, seed {args.seeds[0]}", "xlabel": "round", "ylabel": "test accuracy",
                       "lines": lines, "logx": True})
        bytes_lines = {"Fed3R": (runs["fed3r"][0].bytes_up, runs["fed3r"][0].accuracy),
                       f"FedAvg(ψ) best lr={best[0]} β={best[1]}": (
                           np.add(runs["fedavg"][tuple(best)][0].bytes_up, runs["fedavg"][tuple(best)][0].bytes_down),
                           runs["fedavg"][tuple(best)][0].accuracy)}
        panels.append({"title": f"{split_name}: accuracy vs bytes up+down", "xlabel": "bytes", "ylabel": "test accuracy",
                       "lines": bytes_lines, "logx": True})
    c_bar = float(np.mean([s["c_bar"] for s in report["splits"].values()]))
    print("\n".join(cost_model_table(fte.shape[1], args.devices, args.kappa, c_bar)))
    print("  -> Fed3R moves fewer bytes than FedAvg(ψ) whenever FedAvg(ψ) needs more than R* rounds: "
          "with C=10 that is a few hundred rounds (FedAvg(ψ) on a 10-class head is cheap per round), with "
          "C ≥ 1000 it is after 2-4 rounds, i.e. Fed3R wins on bytes in the many-class regime.")
    engine = plot_lines(OUT_DIR / "fed3r_vs_fedavg.png", panels)
    (OUT_DIR / "fed3r_vs_fedavg.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {OUT_DIR / 'fed3r_vs_fedavg.png'} ({engine}) and fed3r_vs_fedavg.json")


def summarise(split_name, runs, grid, ridge_acc, args) -> dict:
    def best_acc(curves):
        return float(np.mean([max(c.accuracy) for c in curves]))

    best = max(grid, key=lambda cfg: best_acc(runs["fedavg"][cfg]))
    best_ft = max(grid, key=lambda cfg: best_acc(runs["ft"][cfg]))
    fed3r, fedavg, ft = runs["fed3r"], runs["fedavg"][best], runs["ft"][best_ft]
    n_fed3r_rounds = len(fed3r[0].accuracy)
    print(f"\n=== {split_name} ({len(fed3r)} seeds, C̄ = {np.mean(runs['c_bar']):.2f}) ===")
    for cfg in grid:
        print(f"  FedAvg(ψ) lr={cfg[0]:<5} β={cfg[1]}: best {mean_std([max(c.accuracy) for c in runs['fedavg'][cfg]])}"
              f" | Fed3R+FT(ψ) lr={cfg[0]}×0.1: best {mean_std([max(c.accuracy) for c in runs['ft'][cfg]])}")
    print(f"  Fed3R final {mean_std([c.accuracy[-1] for c in fed3r])} after {n_fed3r_rounds} rounds "
          f"(centralized ridge {ridge_acc:.4f}); tuned FedAvg(ψ) = lr {best[0]}, β {best[1]}")
    out = {"best_fedavg": list(best), "best_ft": list(best_ft), "c_bar": float(np.mean(runs["c_bar"])),
           "fed3r_final": [c.accuracy[-1] for c in fed3r],
           "fedavg_best": {str(cfg): [max(c.accuracy) for c in runs["fedavg"][cfg]] for cfg in grid},
           "ft_best": {str(cfg): [max(c.accuracy) for c in runs["ft"][cfg]] for cfg in grid}, "targets": {}}
    targets = {"(i) FedAvg(ψ) best": [max(c.accuracy) for c in fedavg],
               "(ii) ridge − 1pt": [ridge_acc - 0.01] * len(fed3r)}
    for name, per_seed in targets.items():
        a = [f.at(f.first_round_reaching(t)) for f, t in zip(fed3r, per_seed)]
        b = [g.at(g.first_round_reaching(t)) for g, t in zip(fedavg, per_seed)]
        out["targets"][name] = {"target": per_seed, "fed3r": a, "fedavg": b}
        print(f"  to reach {name} = {mean_std(per_seed)}:")
        for label, rows in (("Fed3R", a), ("FedAvg(ψ)", b)):
            def stat(key, scale=1.0):
                return mean_std([r[key] / scale if r["rounds"] else None for r in rows])

            print(f"    {label:10s} rounds {mean_std([r['rounds'] for r in rows])}, "
                  f"up {stat('bytes_up', 1e6)} MB, down {stat('bytes_down', 1e6)} MB, "
                  f"head {stat('head_flops', 1e9)} GFLOP, device incl. backbone {stat('device_flops', 1e9)} GFLOP, "
                  f"handler {stat('compute_s')} s")
        both = [(x, y) for x, y in zip(a, b) if x["rounds"] and y["rounds"]]
        if both:
            def ratio(key):
                return np.mean([y[key] / x[key] for x, y in both])

            updown = np.mean([(y["bytes_up"] + y["bytes_down"]) / (x["bytes_up"] + x["bytes_down"]) for x, y in both])
            print(f"    FedAvg(ψ)/Fed3R ratios: rounds {ratio('rounds'):.2f}, bytes up {ratio('bytes_up'):.3f}, "
                  f"bytes up+down {updown:.3f}, head FLOPs {ratio('head_flops'):.3f}, "
                  f"device FLOPs {ratio('device_flops'):.3f}, handler time {ratio('compute_s'):.3f}")
    # Ordering: rounds to reach the random head's best accuracy, Fed3R-initialised vs random.
    tgt = [max(c.accuracy) for c in fedavg]
    r_rand = [g.first_round_reaching(t) for g, t in zip(fedavg, tgt)]
    r_ft = [g.first_round_reaching(t) for g, t in zip(ft, tgt)]
    for level in (0.70, 0.75, 0.80):
        rr = [g.first_round_reaching(level) for g in fedavg]
        rf = [g.first_round_reaching(level) for g in ft]
        print(f"  FedAvg rounds to {level:.0%}: random head {mean_std(rr)}, Fed3R init {mean_std(rf)} "
              f"(+{n_fed3r_rounds} Fed3R rounds)")
    print(f"  FedAvg rounds to the random head's best ({mean_std(tgt)}): random head {mean_std(r_rand)}, "
          f"Fed3R init {mean_std(r_ft)} (+{n_fed3r_rounds} Fed3R rounds); Fed3R+FT(ψ) best "
          f"{mean_std([max(c.accuracy) for c in ft])}")
    out["ordering"] = {"target": tgt, "random_rounds": r_rand, "fed3r_init_rounds": r_ft,
                       "fed3r_rounds": n_fed3r_rounds}
    for name, rounds in (("(i)", [r["rounds"] for r in out["targets"]["(i) FedAvg(ψ) best"]["fedavg"]]),
                         ("(ii)", [r["rounds"] for r in out["targets"]["(ii) ridge − 1pt"]["fedavg"]])):
        R = int(np.mean([r for r in rounds if r])) if any(rounds) else None
        for row in cost_model_table(1280, args.devices, args.kappa, float(np.mean(runs["c_bar"])),
                                    {f"target {name}": R})[-1:]:
            print(row)
    return out


if __name__ == "__main__":
    main()
