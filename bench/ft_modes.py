"""Fed3R+FT(ψ) vs Fed3R+FT(φ) vs Fed3R+FT(M) on Fashion-MNIST (MobileNetV2, 32 px).

All three fine-tune from the SAME Fed3R head (normalised classifier, bias included) of each
split × seed, for R FedAvg rounds (κ devices per round, server LR 1, no momentum):

* FT(ψ): ``FedAvgJob`` (init "fed3r"): devices train the head on frozen features
  (``HeadTrainingTask`` running the bundle's ExecuTorch head training program);
* FT(φ): ``TailFedAvgJob`` train="tail": devices train the backbone's last ``--tail-stages``
  stages (BatchNorm frozen) against the frozen Fed3R head (``TailTrainingTask``);
* FT(M): ``TailFedAvgJob`` train="tail+head": tail and head together.

Device LR: base {0.1, 0.01} × 0.1 for the Fed3R init (spec §4 rule), the base picked per mode
and split by mean final accuracy over seeds (the grid is printed). Splits: 2 classes/device
and Dirichlet 0.1 over 100 devices (``fedfleet.emulation.partition``).

Runs the real jobs, device handlers and round machine in-process through encoded envelopes
(``run_job`` of bench/fed3r_vs_fedavg.py, no MQTT), so bytes are real wire sizes. Inputs are
computed once for the whole dataset and sliced per device (what each device's own cache
would hold): backbone features with ``load_features`` (FT(ψ), Fed3R) and trunk activations
with the bundle's ExecuTorch trunk program (``TrunkActivations``, disk-cached).

Tail training runtime. FT(φ)/FT(M) train through the bundle's ExecuTorch tail_training
program by default, as devices do. Training graphs are not XNNPACK-delegated, so the program
runs on ExecuTorch's portable kernels; the tail's pointwise convolutions are exported as
matrix products (``edge_client.models.tail.PointwiseConv2d``), which made a task 14× cheaper
than with the portable convolution kernels (4.0 -> 0.28 s per first-round task here; FT(ψ)'s
head program: 0.02 s). ``--tail-runtime eager`` runs the program's eager twin instead (the
torch module it is exported from, gradient/SGD parity-checked at export; about 2× faster
here) for longer studies; a sample of tasks (``--et-sample`` devices, same task, same start
model) always runs through the ExecuTorch programs too, timed, and its update is compared
with the eager twin's. Handler seconds exclude the one-off backbone/trunk pass (cached) and
program loading (the emulated devices share one loaded program each, as they share the trunk).

OLL after each mode (``--oll``, on by default; the Fed3R paper's Table 6 compares OLL after
Fed3R+FedAvg(ψ) and after Fed3R+FedAvg(φ)). Each device keeps ``--holdout`` (0.2, as
``fedfleet simulate``) of its samples as a local held-out split
(``fedfleet.emulation.partition.train_holdout_split``, seeded seed·1000 + device, as the
simulator and bench/personalization.py); Fed3R and every fine-tuning run train on the rest
only, so with ``--oll`` the mode comparison above trains on 80 % of each device's data
(``--no-oll``: all of it, no held-out split). After the last FT round of every run (and for the
Fed3R start) the real ``PersonalizeJob`` sends the final model to every device, through
``run_job``, and each device's ``PersonalizeTask`` reports how many held-out samples the global
model and OLL (the head pruned to its local training labels) get right; after FT(φ)/FT(M) the
task carries the fine-tuned ``tail.*`` tensors and the device personalises on the fine-tuned
backbone's features (``TailFeatures``: cached trunk activations, then the tail program's eager
twin). ``--oll-fp-epochs N`` adds OLL+FP(ψ) (N local epochs, the job's fp_lrs chosen by 5-fold
cross-validation on the device; 0, the default: OLL only). WMA = Σ correct / Σ held-out
samples over devices; held-out labels never seen in local training are scored by the global
head (fallback "global"). Differences are per seed, then mean ± std and the seeds' signs.

Usage: .venv/bin/python bench/ft_modes.py [--rounds 20] [--seeds 0 1 2] [--tail-stages 1] [--quick]
    [--no-oll | --holdout 0.2 --oll-fp-epochs 0]
Writes runs/bench/ft_modes.{json,png}.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import sys
import time

import numpy as np
import torch

from fed3r_vs_fedavg import (BACKBONE, IMAGE_SIZE, NUM_CLASSES, OUT_DIR, REPO, SPLITS,  # noqa: E402
                             CachedFeatures, Fleet, backbone_flops_per_image,
                             load_features, mean_std, run_fed3r, run_fedavg, run_job)

from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob  # noqa: E402
from aggregator.jobs.fedavg_tail import TailFedAvgConfig, TailFedAvgJob  # noqa: E402
from aggregator.jobs.personalize import PersonalizeConfig, PersonalizeJob  # noqa: E402
from aggregator.compute.tail_program import TailProgram  # noqa: E402
from edge_client.runtime import TrainingSession  # noqa: E402
from edge_client.runtime.executorch_runtime import set_executorch_threads  # noqa: E402
from edge_client.tasks.head_training import HeadTrainingTask  # noqa: E402
from edge_client.tasks.personalization import PersonalizeTask  # noqa: E402
from edge_client.tasks.tail_training import TailFeatures, TailTrainingTask, TrunkActivations  # noqa: E402
from fedfleet.bundles import ensure_tail_bundle  # noqa: E402
from fedfleet.emulation.partition import make_split, train_holdout_split  # noqa: E402
from fedfleet.plots import plot_lines  # noqa: E402

PSI, PHI, FULL = "FT(ψ)", "FT(φ)", "FT(M)"
MODES = (PSI, PHI, FULL)
TAIL_TRAIN = {PHI: "tail", FULL: "tail+head"}
BASE_LRS = (0.1, 0.01)                       # × 0.1 on the device (Fed3R init), spec §4
FED3R = "Fed3R"                              # the shared start, personalised without fine-tuning
HOLDOUT = 0.2                                # of each device's samples, as fedfleet simulate's default


# ----------------------------------------------------------------------------- device side
def psi_handlers(fleet: Fleet, manifest, session) -> dict:
    """FT(ψ) handlers: the fleet's devices, training through the bundle's head program."""
    # emulated devices run one after another, so they share one loaded program (as they share the trunk)
    return {dev: HeadTrainingTask(t.images, t.labels, t.extractor_factory, str(manifest), session=session)
            for dev, t in fleet.head.items()}


def tail_handlers(fleet: Fleet, train_acts: np.ndarray, manifest, session) -> dict:
    """FT(φ)/FT(M) handlers: each device's rows of the trunk activations, as its cache would hold."""
    return {dev: TailTrainingTask(t.images, t.labels, manifest, trunk=CachedFeatures(t.images, train_acts[idx]),
                                  session=session)
            for (dev, t), idx in zip(fleet.head.items(), fleet.parts)}


class WarmCaches:
    """Warm caches of several image arrays (``CachedFeatures`` each): ``extract`` returns the
    precomputed rows of whichever known array it is given (by identity, as CachedFeatures)."""

    def __init__(self, caches: list[CachedFeatures]):
        self.caches = caches
        self.feature_dim = caches[0].feature_dim

    def extract(self, images: np.ndarray) -> np.ndarray:
        for cache in self.caches:
            if images is cache.images:
                return cache.features
        raise ValueError("these cached rows only know the fleet's own image arrays")


def split_holdouts(parts: list[np.ndarray], holdout: float, seed: int) -> tuple[list, list]:
    """(training parts, held-out parts): each device's local held-out split, seeded as
    ``fedfleet simulate`` seeds it (seed·1000 + device index)."""
    pairs = [train_holdout_split(p, holdout, seed * 1000 + k) for k, p in enumerate(parts)]
    return [t for t, _ in pairs], [h for _, h in pairs]


def personalize_handlers(fleet: Fleet, holdout_parts: list[np.ndarray], data, acts: dict, manifest) -> dict:
    """``oll.personalize`` handlers of the devices with a non-empty held-out split: frozen
    features from each device's warm feature cache, fine-tuned-backbone features from one
    ``TailFeatures`` shared by the fleet (one eager tail session, one trunk cache, as
    fedfleet's emulation worker shares them)."""
    images, labels, feats = data["train"]
    handlers, trunk_caches = {}, []
    for (dev, t), train_idx, held_idx in zip(fleet.head.items(), fleet.parts, holdout_parts):
        if not len(held_idx):
            continue            # nothing to evaluate on (a 1-sample device): not asked, as in the simulator
        held_images = images[held_idx]
        frozen = WarmCaches([CachedFeatures(t.images, feats[train_idx]), CachedFeatures(held_images, feats[held_idx])])
        trunk_caches += [CachedFeatures(t.images, acts["train"][train_idx]),
                         CachedFeatures(held_images, acts["train"][held_idx])]
        handlers[dev] = (t.images, t.labels, held_images, labels[held_idx],
                         (lambda cached: lambda *a, **k: cached)(frozen))
    tail_features = TailFeatures(manifest, trunk=WarmCaches(trunk_caches))
    return {dev: PersonalizeTask(*h, tail_features=tail_features) for dev, h in handlers.items()}


def tail_flops(tail_stages: int, activation_shape) -> float:
    """Forward FLOPs of the tail for one sample (FlopCounterMode on the split backbone)."""
    from torch.utils.flop_counter import FlopCounterMode

    from edge_client.models import build_backbone
    from edge_client.models.tail import split_backbone

    _, tail = split_backbone(build_backbone(BACKBONE, pretrained=False), tail_stages)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tail(torch.zeros(1, *activation_shape))
    return float(counter.get_total_flops())


# ----------------------------------------------------------------------------- jobs
def tail_job(program: TailProgram, program_file, fed3r_model, mode, seed, kappa, rounds, base_lr, tail_stages):
    cfg = TailFedAvgConfig(num_classes=NUM_CLASSES, image_size=IMAGE_SIZE, feature_dim=fed3r_model.coef_.shape[1],
                           rounds=rounds, clients_per_round=kappa, client_lr=base_lr, seed=seed, init="fed3r",
                           train=TAIL_TRAIN[mode], tail_stages=tail_stages, tail_program_file=str(program_file))
    # FedAvgJob.from_fed3r's head, with the one loaded tail program shared by every job.
    return TailFedAvgJob(cfg, initial_head={"weight": fed3r_model.coef_, "bias": fed3r_model.intercept_},
                         program=program)


def run_oll(ctx, model: dict[str, np.ndarray], tail_stages: int, seed: int, args) -> dict:
    """Personalise ``model`` ({weight, bias} and, after FT(φ)/FT(M), the ``tail.*`` tensors) on
    every device with a held-out split through PersonalizeJob → PersonalizeTask: the job's
    summary (WMA per method, fallback count) and the seconds it took."""
    head = {k: model[k] for k in ("weight", "bias")}
    tail = {k: v for k, v in model.items() if k not in head}
    handlers = ctx["personalize_handlers"]
    cfg = PersonalizeConfig(job_id="oll", num_classes=NUM_CLASSES, image_size=IMAGE_SIZE, backbone=BACKBONE,
                            feature_dim=head["weight"].shape[1], tail_stages=tail_stages if tail else 0,
                            fallback="global", fp_epochs=args.oll_fp_epochs, clients_per_round=len(handlers),
                            seed=seed)
    job = PersonalizeJob(cfg, head=head, tail=tail)
    t0 = time.perf_counter()
    run_job(job, handlers, {dev: 0 for dev in handlers}, (None, None), lambda params, n: 0.0, 0.0)
    summary = job.summary()
    if job.contributions != len(handlers):
        raise RuntimeError(f"only {job.contributions} of {len(handlers)} devices reported")
    return {**summary, "s": time.perf_counter() - t0}


def run_mode(mode, ctx, seed, base_lr, args) -> dict:
    """One FT run from the Fed3R head: accuracy after rounds 0..R and the wire / compute totals
    (and, with --oll, the final model's personalised WMA on the devices' held-out splits)."""
    if mode == PSI:
        job, curve = run_fedavg(ctx["psi_fleet"], ctx["feature_eval"], seed, args.kappa, args.rounds, base_lr, 0.0,
                                ctx["backbone_flops"], ctx["fed3r_model"])
        acc0 = ctx["fed3r_accuracy"]
    else:
        job = tail_job(ctx["program"], ctx["program_file"], ctx["fed3r_model"], mode, seed, args.kappa, args.rounds,
                       base_lr, args.tail_stages)
        acc0 = job.evaluate(*ctx["trunk_eval"])["accuracy"]
        curve = run_job(job, ctx["tail_handlers"], ctx["fleet"].sizes, ctx["trunk_eval"], ctx["tail_task_flops"],
                        ctx["trunk_flops"])
    tasks = sum(r["updates"] for r in job.round_log)
    out = {"accuracy": [acc0, *curve.accuracy], "tasks": tasks,
           "up_per_task": curve.bytes_up[-1] / tasks, "down_per_task": curve.bytes_down[-1] / tasks,
           "s_per_task": curve.compute_s[-1] / tasks, "train_flops_per_task": curve.head_flops[-1] / tasks}
    if args.oll:
        out["oll"] = run_oll(ctx, job.model_arrays(), args.tail_stages, seed, args)   # what model.npz holds
    return out


def executorch_sample(ctx, sessions, devices, tail_stages) -> dict:
    """The same first-round task (Fed3R start, spec-rule LR) on ``devices`` through the ExecuTorch
    programs: seconds per task per mode, and FT(φ)/FT(M) updates vs the eager twin's."""
    model, manifest = ctx["fed3r_model"], ctx["manifest"]
    fleet = dataclasses.replace(ctx["fleet"], head={d: ctx["fleet"].head[d] for d in devices},
                                parts=[ctx["fleet"].parts[list(ctx["fleet"].head).index(d)] for d in devices])
    psi_job = FedAvgJob.from_fed3r(FedAvgConfig(num_classes=NUM_CLASSES, image_size=IMAGE_SIZE,
                                                feature_dim=model.coef_.shape[1]), model)
    handlers = {"psi": psi_handlers(fleet, manifest, sessions["head"]),
                "executorch": tail_handlers(fleet, ctx["train_acts"], manifest, sessions["tail_executorch"]),
                "eager": tail_handlers(fleet, ctx["train_acts"], manifest, sessions["tail_eager"])}
    out = {}
    for mode in MODES:
        job = psi_job if mode == PSI else tail_job(ctx["program"], ctx["program_file"], model, mode, 0, 10, 1, 0.1,
                                                   tail_stages)
        secs, diffs = [], []
        for dev in devices:
            params, tensors = job.task_for(dev)
            t0 = time.perf_counter()
            _, trained = handlers["psi" if mode == PSI else "executorch"][dev](params, tensors)
            secs.append(time.perf_counter() - t0)
            if mode != PSI:
                _, twin = handlers["eager"][dev](params, tensors)
                diffs.append(max(float(np.abs(trained[k] - twin[k]).max()) for k in trained))
        out[mode] = {"s_per_task": float(np.mean(secs)), "max_abs_diff_vs_eager": max(diffs) if diffs else None}
    return out


# ----------------------------------------------------------------------------- reporting
def rounds_to(curve: list[float], target: float) -> int | None:
    """FT rounds until ``curve`` (accuracy after rounds 1, 2, ...) first reaches ``target``."""
    hits = [i for i, a in enumerate(curve) if a >= target - 1e-12]
    return hits[0] + 1 if hits else None


def summarise(split_name: str, runs: dict, args) -> dict:
    """Grid, chosen LR per mode, the table rows and the orderings of one split."""
    def final(mode, lr):
        return [r["accuracy"][-1] for r in runs[mode][lr]]

    chosen = {mode: max(BASE_LRS, key=lambda lr: np.mean(final(mode, lr))) for mode in MODES}
    print(f"\n=== {split_name} ({len(args.seeds)} seeds, {args.rounds} rounds, κ={args.kappa}, "
          f"{args.devices} devices, tail {args.tail_stages} stage(s)) ===")
    print("  LR grid (device LR = base × 0.1), final accuracy:")
    for mode in MODES:
        print(f"    {mode}: " + " | ".join(f"base {lr}: {mean_std(final(mode, lr))}" + (" *" if lr == chosen[mode] else "")
                                        for lr in BASE_LRS))
    best = {mode: runs[mode][chosen[mode]] for mode in MODES}
    # "best" and the target are over FT rounds 1..R: round 0 is the shared Fed3R start.
    psi_best = [max(r["accuracy"][1:]) for r in best[PSI]]
    rows = {}
    for mode in MODES:
        rs = best[mode]
        rows[mode] = {
            "base_lr": chosen[mode], "round0": [r["accuracy"][0] for r in rs], "final": [r["accuracy"][-1] for r in rs],
            "best": [max(r["accuracy"][1:]) for r in rs],
            "rounds_to_psi_best": [rounds_to(r["accuracy"][1:], t) for r, t in zip(rs, psi_best)],
            "up_per_task": float(np.mean([r["up_per_task"] for r in rs])),
            "down_per_task": float(np.mean([r["down_per_task"] for r in rs])),
            "s_per_task": float(np.mean([r["s_per_task"] for r in rs])),
            "train_flops_per_task": float(np.mean([r["train_flops_per_task"] for r in rs]))}
    ref = rows[PSI]
    print(f"  {'mode':6s} {'LR':>5s} {'round 0':>13s} {'final':>13s} {'best (r≥1)':>13s} {'rounds→ψ best':>18s} "
          f"{'up B/task':>10s} {'down B/task':>11s} {'s/task':>7s} | ratios vs FT(ψ): up, down, s, FLOPs")
    for mode, r in rows.items():
        print(f"  {mode:6s} {r['base_lr']:5g} {mean_std(r['round0']):>13s} {mean_std(r['final']):>13s} "
              f"{mean_std(r['best']):>13s} {mean_std(r['rounds_to_psi_best']):>18s} {r['up_per_task']:10.0f} "
              f"{r['down_per_task']:11.0f} {r['s_per_task']:7.3f} | {r['up_per_task'] / ref['up_per_task']:.1f}, "
              f"{r['down_per_task'] / ref['down_per_task']:.1f}, {r['s_per_task'] / ref['s_per_task']:.1f}, "
              f"{r['train_flops_per_task'] / ref['train_flops_per_task']:.1f}")
    orderings = collections.Counter(
        " > ".join(sorted(MODES, key=lambda m: -rows[m]["final"][i])) for i in range(len(args.seeds)))
    print("  ordering by final accuracy: " + "; ".join(f"{o}: {n}/{len(args.seeds)} seeds" for o, n in orderings.items()))
    pairs = {f"{a} > {b}": sum(x > y for x, y in zip(rows[a]["final"], rows[b]["final"]))
             for a, b in itertools.permutations(MODES, 2)}
    print("  pairwise, final accuracy: " + ", ".join(f"{k} in {v}/{len(args.seeds)}" for k, v in pairs.items()))
    return {"chosen_base_lr": chosen, "rows": rows, "orderings": dict(orderings), "pairwise": pairs,
            "grid": {mode: {str(lr): runs[mode][lr] for lr in BASE_LRS} for mode in MODES}}


def signed_difference(a: list[float], b: list[float]) -> dict:
    """Per-seed a − b in accuracy points, its mean ± std, and how many seeds have it > 0 / < 0."""
    d = [100.0 * (x - y) for x, y in zip(a, b)]
    return {"points": d, "mean": float(np.mean(d)), "std": float(np.std(d)),
            "positive": sum(x > 0 for x in d), "negative": sum(x < 0 for x in d), "seeds": len(d)}


def format_difference(diff: dict) -> str:
    return (f"{diff['mean']:+.2f}±{diff['std']:.2f} pts ({diff['positive']}/{diff['seeds']} seeds > 0, "
            f"{diff['negative']}/{diff['seeds']} < 0)")


def summarise_oll(fed3r_oll: list[dict], runs: dict, chosen: dict, args) -> dict:
    """Personalised WMA per model (Fed3R start and each mode at its chosen LR) and the per-seed
    differences: OLL − global per model, OLL after FT(φ)/FT(M) − OLL after FT(ψ), and OLL after
    each mode − OLL of the Fed3R start."""
    oll = {FED3R: fed3r_oll, **{mode: [r["oll"] for r in runs[mode][chosen[mode]]] for mode in MODES}}
    methods = [m for m in ("global", "oll", "oll_fp") if m in fed3r_oll[0]["wma"]]
    wma = {name: {m: [s["wma"][m] for s in summaries] for m in methods} for name, summaries in oll.items()}
    print(f"  personalised WMA on the devices' held-out splits ({args.holdout:.0%} of each device, "
          f"{np.mean([s['test_samples'] for s in fed3r_oll]):.0f} samples, "
          f"{np.mean([s['fallback_samples'] for s in fed3r_oll]):.1f} with a label unseen in local training: scored "
          f"by the global head; {mean_std([s['mean_local_classes'] for s in fed3r_oll])} local classes per device; "
          f"PersonalizeJob → "
          f"PersonalizeTask{f', FP(ψ) {args.oll_fp_epochs} epochs' if args.oll_fp_epochs else ''}):")
    print(f"  {'model':14s} " + " ".join(f"{m:>15s}" for m in methods) + f" {'OLL − global':>40s}")
    differences = {}
    for name, vals in wma.items():
        label = name if name == FED3R else f"Fed3R+{name}"
        differences[f"{label}: OLL − global"] = signed_difference(vals["oll"], vals["global"])
        if "oll_fp" in vals:
            differences[f"{label}: OLL+FP(ψ) − OLL"] = signed_difference(vals["oll_fp"], vals["oll"])
        print(f"  {label:14s} " + " ".join(f"{mean_std(vals[m]):>15s}" for m in methods)
              + f" {format_difference(differences[f'{label}: OLL − global']):>40s}")
    for a, b in ((PHI, PSI), (FULL, PSI), (PHI, FULL), *((m, FED3R) for m in MODES)):
        for m in methods[1:]:
            key = f"{'OLL' if m == 'oll' else 'OLL+FP(ψ)'} after {a} − after {b}"
            differences[key] = signed_difference(wma[a][m], wma[b][m])
            print(f"  {key}: {format_difference(differences[key])}")
    return {"wma": wma, "differences": differences,
            "fallback_samples": [s["fallback_samples"] for s in fed3r_oll],
            "test_samples": [s["test_samples"] for s in fed3r_oll],
            "personalize_s": {name: float(np.mean([s["s"] for s in summaries])) for name, summaries in oll.items()}}


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20,
                    help="FT rounds per run (20: ~35 min on 2 shared cores with the ExecuTorch tail, ~18 with eager)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--devices", type=int, default=100)
    ap.add_argument("--train-size", type=int, default=60000, help="the first N training images are split")
    ap.add_argument("--kappa", type=int, default=10)
    ap.add_argument("--tail-stages", type=int, default=1)
    ap.add_argument("--tail-runtime", choices=("eager", "executorch"), default="executorch",
                    help="runtime of the tail_training program in the FT(φ)/FT(M) runs (see the docstring)")
    ap.add_argument("--et-sample", type=int, default=3, help="devices whose first task also runs through ExecuTorch")
    ap.add_argument("--threads", type=int, default=1, help="torch / ExecuTorch threads")
    ap.add_argument("--oll", action=argparse.BooleanOptionalAction, default=True,
                    help="hold out part of each device and report OLL after each mode (--no-oll: train on all of it)")
    ap.add_argument("--holdout", type=float, default=HOLDOUT, help="fraction of each device held out for OLL evaluation (with --oll)")
    ap.add_argument("--oll-fp-epochs", type=int, default=0,
                    help="FP(ψ) epochs after OLL (0: OLL only; FP picks its LR by 5-fold CV on each device)")
    ap.add_argument("--quick", action="store_true", help="1 seed, 5 rounds, 30 devices on 18000 images, 1 ET sample")
    args = ap.parse_args(argv)
    if args.oll and not 0 < args.holdout < 1:
        ap.error("--holdout must be in (0, 1) with --oll (every device needs held-out samples to evaluate on)")
    if args.quick:
        args.seeds, args.rounds, args.devices = args.seeds[:1], min(args.rounds, 5), min(args.devices, 30)
        args.train_size, args.et_sample = min(args.train_size, 600 * args.devices), min(args.et_sample, 1)
    wall0 = time.perf_counter()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    set_executorch_threads(args.threads)

    data, _ = load_features()
    manifest = ensure_tail_bundle(BACKBONE, IMAGE_SIZE, NUM_CLASSES, args.tail_stages)
    data["train"] = tuple(a[:args.train_size] for a in data["train"])
    trunk = TrunkActivations(manifest, cache_dir=str(REPO / ".cache" / "features"))
    acts = {}
    for split in ("train", "test"):
        t0 = time.perf_counter()
        acts[split] = trunk.extract(data[split][0])
        print(f"trunk activations {split}: {acts[split].shape} in {time.perf_counter() - t0:.1f}s "
              "(ExecuTorch trunk program; disk-cached after the first run)", flush=True)
    program_file = manifest.parent / "tail_eval.pt2"
    sessions = {"head": TrainingSession.load(manifest, prefer=("executorch",)),
                "tail_executorch": TrainingSession.load(manifest, prefer=("executorch",), kind="tail_training"),
                "tail_eager": TrainingSession.load(manifest, prefer=("eager",), kind="tail_training")}
    fflops = backbone_flops_per_image()
    f_tail = tail_flops(args.tail_stages, trunk.shape)
    d, C = 1280, NUM_CLASSES
    ctx = {"program": TailProgram(program_file), "program_file": program_file,
           "feature_eval": (data["test"][2], data["test"][1]),
           "trunk_eval": (acts["test"].reshape(len(acts["test"]), -1), data["test"][1]),
           "backbone_flops": fflops, "trunk_flops": fflops - f_tail,
           # Spec cost model (backward ≈ 2× forward), as fedavg_head_flops = 3·E·n·(2dC) for FT(ψ).
           "tail_task_flops": lambda params, n: 3.0 * params["epochs"] * n * (f_tail + 2 * d * C),
           "manifest": manifest, "train_acts": acts["train"],
           "tail_runtime_key": f"tail_{args.tail_runtime}"}
    print(f"bundle {manifest.parent.name}: activations {trunk.shape}, tail {f_tail / 1e6:.2f} MFLOP/sample, "
          f"backbone {fflops / 1e6:.2f} MFLOP/sample; FT(φ)/FT(M) train with the {args.tail_runtime} tail program\n",
          flush=True)

    report = {"args": vars(args), "splits": {}}
    panels = []
    for split_name, (kind, split_params) in SPLITS.items():
        runs = {mode: {lr: [] for lr in BASE_LRS} for mode in MODES}
        fed3r_oll = []          # the Fed3R start's personalization summary, per seed
        for seed in args.seeds:
            t0 = time.perf_counter()
            parts = make_split(kind, data["train"][1], args.devices, seed, **split_params)
            if args.oll:        # the federation trains on each device's training split only
                parts, holdout_parts = split_holdouts(parts, args.holdout, seed)
            fleet = Fleet.build(data, parts)
            fed3r_job, fed3r_curve = run_fed3r(fleet, ctx["feature_eval"], seed, args.kappa, fflops)
            ctx.update(fleet=fleet, fed3r_model=fed3r_job.model(), fed3r_accuracy=fed3r_curve.accuracy[-1],
                       psi_fleet=dataclasses.replace(fleet, head=psi_handlers(fleet, manifest, sessions["head"])),
                       tail_handlers=tail_handlers(fleet, acts["train"], manifest, sessions[ctx["tail_runtime_key"]]))
            if args.oll:
                ctx["personalize_handlers"] = personalize_handlers(fleet, holdout_parts, data, acts, manifest)
                fed3r_head = {"weight": ctx["fed3r_model"].coef_, "bias": ctx["fed3r_model"].intercept_}
                fed3r_oll.append(run_oll(ctx, fed3r_head, 0, seed, args))
                if seed == args.seeds[0] and split_name == next(iter(SPLITS)):
                    # The two feature paths must agree: the Fed3R head on the pretrained tail (trunk
                    # program + eager tail) vs on the frozen extractor's features.
                    via_tail = run_oll(ctx, {**ctx["program"].tail_parameters, **fed3r_head}, args.tail_stages,
                                       seed, args)
                    report["oll_feature_path_check"] = {"frozen": fed3r_oll[-1]["wma"], "tail": via_tail["wma"]}
                    print("OLL feature paths, Fed3R head: frozen extractor " + ", ".join(
                        f"{m} {v:.4f}" for m, v in fed3r_oll[-1]["wma"].items()) + " | trunk + pretrained tail "
                        + ", ".join(f"{m} {v:.4f}" for m, v in via_tail["wma"].items()), flush=True)
            if seed == args.seeds[0] and split_name == next(iter(SPLITS)):
                sample = executorch_sample(ctx, sessions, list(fleet.sizes)[:args.et_sample], args.tail_stages)
                report["executorch_sample"] = sample
                ref = sample[PSI]["s_per_task"]
                print("ExecuTorch programs, same task on " + f"{args.et_sample} device(s): " + "; ".join(
                    f"{m} {v['s_per_task']:.3f} s/task ({v['s_per_task'] / ref:.0f}× FT(ψ))"
                    + (f", max |Δ| vs eager twin {v['max_abs_diff_vs_eager']:.1e}" if v["max_abs_diff_vs_eager"]
                       is not None else "") for m, v in sample.items()), flush=True)
            for mode in MODES:
                for lr in BASE_LRS:
                    runs[mode][lr].append(run_mode(mode, ctx, seed, lr, args))
            print(f"[{split_name}] seed {seed}: Fed3R {fed3r_curve.accuracy[-1]:.4f} after {len(fed3r_curve.accuracy)} "
                  "rounds; final " + ", ".join(f"{m} {runs[m][lr][-1]['accuracy'][-1]:.4f}@{lr}"
                                               for m in MODES for lr in BASE_LRS)
                  + (f"; OLL WMA Fed3R {fed3r_oll[-1]['wma']['oll']:.4f}, " + ", ".join(
                      f"{m} {runs[m][lr][-1]['oll']['wma']['oll']:.4f}@{lr}" for m in MODES for lr in BASE_LRS)
                     if args.oll else "")
                  + f"; {time.perf_counter() - t0:.0f}s", flush=True)
        summary = summarise(split_name, runs, args)
        if args.oll:
            summary["oll"] = summarise_oll(fed3r_oll, runs, summary["chosen_base_lr"], args)
        report["splits"][split_name] = summary
        x = np.arange(args.rounds + 1)
        panels.append({"title": f"{split_name}: mean of {len(args.seeds)} seed(s)", "xlabel": "FT round (0 = Fed3R)",
                       "ylabel": "test accuracy",
                       "lines": {f"{m} base lr {lr}" + (" (chosen)" if lr == summary["chosen_base_lr"][m] else ""):
                                 (x, np.mean([r["accuracy"] for r in runs[m][lr]], axis=0))
                                 for m in MODES for lr in BASE_LRS}})
    sample = report["executorch_sample"]
    print("\ndevice compute through the ExecuTorch programs (same first-round task, sampled), vs FT(ψ): "
          + ", ".join(f"{m} {v['s_per_task']:.3f} s/task = {v['s_per_task'] / sample[PSI]['s_per_task']:.0f}×"
                      for m, v in sample.items()))
    engine = plot_lines(OUT_DIR / "ft_modes.png", panels)
    report["wall_s"] = time.perf_counter() - wall0
    (OUT_DIR / "ft_modes.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {OUT_DIR / 'ft_modes.png'} ({engine}) and ft_modes.json; wall {report['wall_s']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
