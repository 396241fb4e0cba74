"""Attacks and defences (issue #26): test accuracy of Fed3R and FedAvg(ψ) with 1/10/20 % of the
demo fleet malicious, per defence, against the honest-only run.

Fleet: the demo's 100 devices, Dirichlet α = 0.1, over a seeded subset of 6,000 Fashion-MNIST
training images; MobileNetV2 features at 32 px, computed once (eager) and cached in .cache/features.
The malicious devices are the first ⌈f·K⌉ device ids (the seeded split makes them arbitrary);
every job runs through the real job code (results encoded, decoded, validated: a refused result
counts as not delivered). Attacks (what a malicious device sends):

- ``scaling``: Fed3R: its features ×1000 (a genuine Gram matrix, labels kept); FedAvg: θ_t + 20·Δ;
- ``scaling_in_range``: Fed3R only: features ×3, clipped to the backbone's range [0, 6];
- ``label_flip``: trains on / sums labels C − 1 − y;
- ``sign_flip``: FedAvg: θ_t − 4·Δ; Fed3R: b negated (A kept);
- ``alie`` ("a little is enough", Baruch et al. 2019), FedAvg only: every attacker of a round sends
  μ − z·σ of that round's honest updates, coordinate-wise, z from the paper's rule;
- ``backdoor``: its images get a 4×4 white patch (bottom right) and label 0, added to its clean
  data; "backdoor" is the share of patched test images (true label ≠ 0) classified 0.

Defences: Fed3R ``none`` (max_abs_feature 0, screen off) and ``default`` (the bound F = 6 and the
fleet energy screen; a screened device is quarantined and the job re-summed without it, as the
service does); FedAvg ``none`` (every layer off: FedAvg's mean), ``default`` (the job's defaults:
norm bound 1x the round's median, contribution bound 0.5x, direction screen, round history
β = 0.7, mean), ``no screen`` / ``no history`` / ``no weight bound`` (the default less one layer),
``bound 1x`` (the second default: the norm bound alone), ``bound 3x`` (the first default),
``bound 1.5x``, ``centered_clipping`` (τ = the median distance, 3 iterations, no norm bound), and
with the 1x bound ``median``, ``trimmed_mean`` (β = 0.2), ``multi_krum`` (f = 2).
Secure aggregation, the malicious fraction at 10 %, reported as it is (in-process SecAgg rounds):
Fed3R-Sync with the group check; FedAvg(ψ) with devices clipping ‖Δ‖ to ``SECURE_CLIP`` before
masking and the group check, with and without the round history (``SECURE_FEDAVG_DEFENCES``).

FedAvg devices train with the numpy head step (``edge_client/tasks/numpy_head.py``: the
torch-free device's, the same SGD step as eager torch), since torch's per-step overhead dominates
a 1280 x 10 head: a 30-round run takes about a second, so each figure is a mean over ``--seeds``
seeds (the seed draws the split, hence which devices are malicious, and the participation
schedule), and "vs honest" is paired: each seed's run against the same seed's honest run. One
run's final accuracy moves by several points from seed to seed on this non-IID fleet.

Usage: nice -n 10 .venv/bin/python bench/robustness.py [--quick] [--plot-only] [--fedavg-only]
       [--seeds S] [--rounds T] [--defences a,b]
Writes runs/bench/robustness.{json,png} and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import numpy as np
import torch
from scipy.stats import norm

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob  # noqa: E402
from aggregator.jobs.registry import build_job  # noqa: E402
from aggregator.jobs.robustness_fields import PLAIN_MEAN  # noqa: E402
from aggregator.jobs.secure_rounds import GroupSumOutOfBound  # noqa: E402
from aggregator.jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob  # noqa: E402
from dp_accuracy import CachedRows, load_features  # noqa: E402
from edge_client.fed3r import Fed3RAccumulator  # noqa: E402
from edge_client.tasks import head_training  # noqa: E402
from edge_client.tasks.head_training import HeadTrainingTask  # noqa: E402
from edge_client.tasks.numpy_head import NumpyHeadStepper  # noqa: E402
from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining  # noqa: E402
from fedfleet.emulation.partition import make_split  # noqa: E402
from protocols import messages as M  # noqa: E402
from protocols.envelope import EnvelopeError, decode, encode  # noqa: E402
from protocols.payloads.fed3r import encode_stats  # noqa: E402
from protocols.payloads.secagg import SYNC_KIND  # noqa: E402
from protocols.rounds import RoundClosed  # noqa: E402

OUT_DIR = REPO / "runs" / "bench"
D, C = 1280, 10
DEVICES, KAPPA, FEDAVG_ROUNDS = 100, 10, 30
# Secure FedAvg's clip C (update_clip_norm): about the median honest ‖Δ‖ of a first round on this
# fleet (seed 0: 10th/50th/90th percentiles 3.4 / 5.3 / 8.4); the operator sets C, the server sees sums only
SECURE_CLIP = 5.0
LAST_ROUNDS = 5         # FedAvg's "last 5": the mean accuracy of the last rounds' models (less noisy than the final one)
FRACTIONS = (0.01, 0.1, 0.2)
FED3R_ATTACKS = ("scaling", "scaling_in_range", "label_flip", "sign_flip", "backdoor")
FEDAVG_ATTACKS = ("scaling", "label_flip", "sign_flip", "alie", "backdoor")
FED3R_DEFENCES = {"none": {"max_abs_feature": 0.0, "screen_energy_ratio": 0.0}, "default": {}}
BOUND_1X = {**PLAIN_MEAN, "norm_bound_multiplier": 1.0}       # the second default: the norm bound alone
FEDAVG_DEFENCES = {"none": PLAIN_MEAN, "default": {},
                   "no screen": {"direction_screen": False}, "no history": {"history_momentum": 0.0},
                   "no weight bound": {"contribution_bound_multiplier": 0.0},
                   "bound 1x": BOUND_1X, "bound 3x": {**PLAIN_MEAN, "norm_bound_multiplier": 3.0},
                   "bound 1.5x": {**PLAIN_MEAN, "norm_bound_multiplier": 1.5},
                   "centered_clipping": {**PLAIN_MEAN, "aggregator": "centered_clipping"},
                   "median": {**BOUND_1X, "aggregator": "median"},
                   "trimmed_mean": {**BOUND_1X, "aggregator": "trimmed_mean", "trim_fraction": 0.2},
                   "multi_krum": {**BOUND_1X, "aggregator": "multi_krum", "krum_byzantine": 2}}


def with_trigger(images: np.ndarray) -> np.ndarray:
    out = images.copy()
    out[:, -5:-1, -5:-1] = 255
    return out


def load_data(n_train: int, n_test: int):
    """(train features, labels, triggered train features), (test ...)."""
    return load_features(n_train, n_test, also=with_trigger)


# ---------------------------------------------------------------- Fed3R
def fed3r_body(Z, y, negate_b=False, dense=False):
    acc = Fed3RAccumulator(C, Z.shape[1])
    acc.update(Z, y)
    A, ids, b = acc.sparse()
    return encode_stats(A, ids, -b if negate_b else b, acc.n, C, dense=dense)


def fed3r_data(attack, Z, y, Zt):
    """(features, labels, negate b) a device with this data sends under ``attack`` (None: honest)."""
    if attack == "scaling":
        return 1000 * Z, y, False
    if attack == "scaling_in_range":
        return np.clip(3 * Z, 0, 6), y, False
    if attack == "label_flip":
        return Z, C - 1 - y, False
    if attack == "sign_flip":
        return Z, y, True
    if attack == "backdoor":
        return np.vstack([Z, Zt]), np.concatenate([y, np.zeros(len(y), np.int64)]), False
    return Z, y, False


def run_fed3r(devices, bad, attack, defence, test):
    """Final test accuracy, backdoor success, refused and screened devices (honest ones among them)."""
    cfg = {"job_id": "robust-fed3r", "num_classes": C, "feature_dim": D, "clients_per_round": KAPPA,
           **FED3R_DEFENCES[defence]}
    job, ids = build_job("fed3r", cfg), sorted(devices)
    bodies = {d: fed3r_body(*fed3r_data(attack if d in bad else None, *devices[d])) for d in ids}
    refused, screened = set(), set()
    while chosen := job.next_participants(set(ids) - screened - refused):
        for d in chosen:
            msg = M.result_message(d, M.TaskRef(cfg["job_id"], job.round, "x" * 32), "fed3r.stats", *bodies[d])
            try:
                job.apply(d, job.parse_result(decode(encode(msg))))
            except EnvelopeError:
                refused.add(d)
        job.close_round(RoundClosed(job.round, tuple(chosen), (), (), ()))
        if job.screened_out:        # the service quarantines them and re-sums the job from its store
            screened |= set(job.screened_out)
            job = resum(cfg, bodies, set(job.contributed) - screened, job)
    return fed3r_scores(job.model(), test) + ({"refused": sorted(refused), "screened": sorted(screened)},)


def resum(cfg, bodies, keep, old):
    fresh = build_job("fed3r", cfg)
    for d in sorted(keep):
        fresh.apply(d, fresh.parse_result(decode(encode(M.result_message(
            d, M.TaskRef(cfg["job_id"], 1, "x" * 32), "fed3r.stats", *bodies[d])))))
    fresh.round, fresh.attempts, fresh._rng = old.round, old.attempts, old._rng
    fresh.contributed.update({d: n for d, n in old.contributed.items() if d not in fresh.contributed})
    return fresh


def fed3r_scores(model, test):
    (Zte, yte, Zte_trig) = test
    backdoor = Zte_trig[yte != 0]
    return float(model.score(Zte, yte)), float((model.predict(backdoor) == 0).mean())


def run_fed3r_secure(devices, bad, attack, test):
    """Fed3R-Sync with the group check: in-process SecAgg rounds (``bench/dp_accuracy.py``'s driver)."""
    from dp_accuracy import secure_job, secure_round
    from edge_client.tasks.secure_fed3r import SecureFed3R

    class Rows:
        def __init__(self, Z, y):
            self.Z, self.y = Z, y

        def __call__(self, params, tensors=None):
            return fed3r_body(self.Z, self.y, dense=True)

    ids = sorted(devices)
    tasks = {d: Rows(*fed3r_data(attack if d in bad else None, *devices[d])[:2]) for d in ids}
    config = Fed3RSyncConfig(job_id="robust-sync", num_classes=C, feature_dim=D, clients_per_round=KAPPA,
                             max_samples=10_000, phase_timeout_s=30.0)
    job, parts = secure_job(ids, tasks, lambda **keys: Fed3RSyncJob(config, **keys), SecureFed3R)
    while chosen := job.next_participants(set(ids)):
        try:
            secure_round(job, chosen, *parts, job.round)
        except Exception as exc:      # noqa: BLE001 - a discarded group, or a device's refusal, is a result here
            job.secure = None
            job.failed_rounds.append((job.round, f"{type(exc).__name__}: {exc}"))
        job.close_round(RoundClosed(job.round, tuple(chosen), (), (), ()))
    return fed3r_scores(job.model(), test) + ({"discarded_groups": len(job.failed_rounds)},)


# ---------------------------------------------------------------- FedAvg(ψ)
def alie_z(n: int, f: int) -> float:
    s = math.floor(n / 2 + 1) - f
    return float(norm.ppf((n - s) / n)) if n > s else 0.0


def fedavg_data(attack, Z, y, Zt):
    """(features, labels) a FedAvg device trains on under ``attack`` (None: honest); the model
    attacks (scaling, sign flipping, ALIE) train honestly and change what they send."""
    if attack == "label_flip":
        return Z, C - 1 - y
    if attack == "backdoor":
        return np.vstack([Z, Zt]), np.concatenate([y, np.zeros(len(y), np.int64)])
    return Z, y


def run_fedavg(devices, bad, attack, defence, test, seed):
    cfg = {"job_id": "robust-fedavg", "num_classes": C, "feature_dim": D, "rounds": FEDAVG_ROUNDS,
           "clients_per_round": KAPPA, "local_epochs": 1, "batch_size": 16, "client_lr": 0.1, "seed": seed,
           **FEDAVG_DEFENCES[defence]}
    job, ids = build_job("fedavg", cfg), sorted(devices)
    tasks = {d: HeadTrainingTask(*fedavg_data(attack if d in bad else None, *devices[d]), lambda b, s, w: CachedRows())
             for d in ids}
    trail = []          # (accuracy, backdoor) after each round
    while chosen := job.next_participants(set(ids)):
        outputs = {}
        for d in chosen:
            params, tensors = job.task_for(d)
            outputs[d] = (tensors, *tasks[d](params, tensors))
        poison_round(outputs, bad, attack)
        for d in chosen:
            _, body, trained = outputs[d]
            msg = M.result_message(d, M.TaskRef(cfg["job_id"], job.round, "x" * 32), "fedavg.head", body, trained)
            try:
                job.apply(d, job.parse_result(decode(encode(msg))))
            except EnvelopeError:   # refused (e.g. NaN once an undefended model diverged): not delivered
                pass
        job.close_round(RoundClosed(job.round, tuple(chosen), (), (), ()))
        trail.append(head_scores(job.params, test))
    accuracy, backdoor = trail[-1]
    return accuracy, backdoor, {"last5": float(np.mean([a for a, _ in trail[-LAST_ROUNDS:]]))}


class PoisonedTraining:
    """A malicious device's training under secure aggregation: its (possibly poisoned) data's
    update, stretched to θ_t + factor·Δ (scaling: 20, sign flip: −4). ``clips``: whether it still
    clips to the round's C as its task asks (an attacker who stays inside the group's bound) or
    sends the update as it is (one that does not care whether its group is discarded)."""

    def __init__(self, task, factor: float, clips: bool):
        self.task, self.factor, self.clips = task, factor, clips

    def __call__(self, params, tensors):
        body, trained = self.task(params, tensors)
        if self.factor != 1.0:
            trained = {k: (tensors[k] + self.factor * (t - tensors[k])).astype(np.float32) for k, t in trained.items()}
        return body, trained


def secure_handler(identity, aggregator_key, training, noise_rng):
    """The device handler a secure FedAvg device runs: the real one, or for an attacker that does
    not clip, the real one asked without the round's ``update_clip_norm``."""
    handler = SecureFedAvgTraining(identity, aggregator_key, training, noise_rng=noise_rng)
    if isinstance(training, PoisonedTraining) and not training.clips:
        honest_vector = handler.vector
        handler.vector = lambda params, tensors: honest_vector(
            {k: v for k, v in params.items() if k != "update_clip_norm"}, tensors)
    return handler


SECURE_FEDAVG_DEFENCES = {"clip + group check": {}, "clip + group check + history": {"history_momentum": 0.7}}


def run_fedavg_secure(devices, bad, attack, defence, test, seed):
    """FedAvg(ψ) under secure aggregation (in-process SecAgg rounds, ``bench/dp_accuracy.py``'s
    driver): devices clip ‖Δ‖ to ``SECURE_CLIP`` before masking, the server checks each group's sum
    against n·C and discards a group that breaks it. Scaling does not clip (its groups break the
    bound); sign flipping clips (it stays inside); label flipping and the backdoor train honestly on
    poisoned data. A discarded group's round moves nothing. Defences: the clip and group check
    alone, or with the round history (β = 0.7, the plaintext default's; it needs only the sum)."""
    from dp_accuracy import secure_job, secure_round

    cfg = {"job_id": "robust-fedavg-secure", "num_classes": C, "feature_dim": D, "rounds": FEDAVG_ROUNDS,
           "clients_per_round": KAPPA, "local_epochs": 1, "batch_size": 16, "client_lr": 0.1, "seed": seed,
           "update_clip_norm": SECURE_CLIP, "max_samples": 10_000, "phase_timeout_s": 30.0,
           **SECURE_FEDAVG_DEFENCES[defence]}
    ids = sorted(devices)
    tasks = {}
    for d in ids:
        task = HeadTrainingTask(*fedavg_data(attack if d in bad else None, *devices[d]), lambda b, s, w: CachedRows())
        if d in bad and attack in ("scaling", "sign_flip"):
            task = PoisonedTraining(task, 20.0 if attack == "scaling" else -4.0, clips=attack == "sign_flip")
        tasks[d] = task
    config = SecureFedAvgConfig(**cfg)
    job, parts = secure_job(ids, tasks, lambda **keys: SecureFedAvgJob(config, **keys), secure_handler)
    trail = []
    while chosen := job.next_participants(set(ids)):
        try:
            secure_round(job, chosen, *parts, seed * 1000 + job.round)
        except GroupSumOutOfBound as exc:       # what the service does: the group is discarded, reported
            job.secure = None
            job.failed_rounds.append((job.round, str(exc)))
        job.close_round(RoundClosed(job.round, tuple(chosen), (), (), ()))
        trail.append(head_scores(job.params, test))
    accuracy, backdoor = trail[-1]
    return accuracy, backdoor, {"last5": float(np.mean([a for a, _ in trail[-LAST_ROUNDS:]])),
                                "discarded_groups": len(job.failed_rounds)}


def head_scores(params, test) -> tuple[float, float]:
    """(test accuracy, backdoor success) of a linear head."""
    (Zte, yte, Zte_trig) = test
    W, b = params["weight"], params["bias"]
    accuracy = float(((Zte @ W.T + b).argmax(1) == yte).mean())
    backdoor = float(((Zte_trig[yte != 0] @ W.T + b).argmax(1) == 0).mean())
    return accuracy, backdoor


def poison_round(outputs, bad, attack):
    """Model-poisoning attacks rewrite the malicious devices' trained tensors in place."""
    mine = [d for d in outputs if d in bad]
    if not mine or attack not in ("scaling", "sign_flip", "alie"):
        return
    if attack == "alie":
        honest = [d for d in outputs if d not in bad] or mine
        z = alie_z(len(outputs), len(mine))
        for name in ("weight", "bias"):
            stack = np.stack([outputs[d][2][name].astype(np.float64) for d in honest])
            forged = (stack.mean(0) - z * stack.std(0)).astype(np.float32)
            for d in mine:
                outputs[d][2][name] = forged
        return
    factor = 20.0 if attack == "scaling" else -4.0
    for d in mine:
        start, _, trained = outputs[d]
        for name in trained:
            trained[name] = (start[name] + factor * (trained[name] - start[name])).astype(np.float32)


# ---------------------------------------------------------------- the run
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 % attackers only, fewer FedAvg rounds")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--seeds", type=int, default=1, help="FedAvg: runs per figure (seeds seed, seed + 1, ...)")
    ap.add_argument("--rounds", type=int, default=0, help="FedAvg rounds (default 30, 10 with --quick)")
    ap.add_argument("--fedavg-only", action="store_true", help="skip Fed3R and the secure runs")
    ap.add_argument("--defences", default="", help="FedAvg defences to run, comma-separated (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    head_training._plain_stepper = NumpyHeadStepper     # see the module docstring
    out = OUT_DIR / "robustness.json"
    if not args.plot_only:
        rows = run_all(args)
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1))
    rows = json.loads(out.read_text())
    print(table(rows))
    plot(rows, OUT_DIR / "robustness.png")


def fleet(ytr, Xtr, Xtr_trig, seed: int) -> dict:
    parts = make_split("dirichlet", ytr, DEVICES, seed, alpha=0.1)
    return {f"dev{i:04d}": (Xtr[idx], ytr[idx], Xtr_trig[idx]) for i, idx in enumerate(parts) if len(idx)}


def malicious(devices: dict, fraction: float) -> set[str]:
    return set(sorted(devices)[:math.ceil(fraction * len(devices))])


def run_all(args) -> list[dict]:
    global FEDAVG_ROUNDS
    FEDAVG_ROUNDS = args.rounds or (10 if args.quick else FEDAVG_ROUNDS)
    (Xtr, ytr, Xtr_trig), test = load_data(6000, 2000)
    devices = fleet(ytr, Xtr, Xtr_trig, args.seed)
    fractions = (0.1,) if args.quick else FRACTIONS
    fedavg_defences = args.defences.split(",") if args.defences else list(FEDAVG_DEFENCES)
    rows = []

    def record(method, mode, attack, fraction, defence, fn, seed=args.seed):
        t0 = time.perf_counter()
        accuracy, backdoor, extra = fn()
        row = {"method": method, "mode": mode, "attack": attack, "fraction": fraction, "defence": defence,
               "seed": seed, "accuracy": accuracy, "backdoor": backdoor, **extra,
               "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    if not args.fedavg_only:
        for defence in FED3R_DEFENCES:
            record("fed3r", "plain", "honest", 0.0, defence, lambda: run_fed3r(devices, set(), None, defence, test))
        for fraction in fractions:
            for attack in FED3R_ATTACKS:
                for defence in FED3R_DEFENCES:
                    record("fed3r", "plain", attack, fraction, defence,
                           lambda: run_fed3r(devices, malicious(devices, fraction), attack, defence, test))
    for seed in range(args.seed, args.seed + args.seeds):
        seed_devices = fleet(ytr, Xtr, Xtr_trig, seed)
        for attack, fraction in [("honest", 0.0)] + [(a, f) for f in fractions for a in FEDAVG_ATTACKS]:
            bad = malicious(seed_devices, fraction)
            for defence in fedavg_defences:
                record("fedavg", "plain", attack, fraction, defence,
                       lambda: run_fedavg(seed_devices, bad, None if attack == "honest" else attack, defence,
                                          test, seed), seed)
    if not args.fedavg_only:
        bad = malicious(devices, 0.1)
        record("fed3r", "secure", "honest", 0.0, "group check", lambda: run_fed3r_secure(devices, set(), None, test))
        for attack in ("scaling", "scaling_in_range", "label_flip", "backdoor"):
            record("fed3r", "secure", attack, 0.1, "group check", lambda: run_fed3r_secure(devices, bad, attack, test))
        for seed in range(args.seed, args.seed + args.seeds):
            seed_devices = fleet(ytr, Xtr, Xtr_trig, seed)
            bad = malicious(seed_devices, 0.1)
            for attack in ("honest", "scaling", "sign_flip", "label_flip", "backdoor"):
                for defence in SECURE_FEDAVG_DEFENCES:
                    record("fedavg", "secure", attack, 0.0 if attack == "honest" else 0.1, defence,
                           lambda: run_fedavg_secure(seed_devices, set() if attack == "honest" else bad, attack,
                                                     defence, test, seed), seed)
    return rows


def table(rows: list[dict]) -> str:
    """One line per (method, mode, attack, fraction, defence): the mean over seeds of the final
    accuracy and (FedAvg) of the last 5 rounds', each with the mean of every seed's difference to
    its own honest run (the seeds' range in brackets when there are several)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["mode"], r["attack"], r["fraction"], r["defence"]), []).append(r)
    lines = ["| method | mode | attack | malicious | defence | seeds | accuracy | vs honest | last 5 | vs honest "
             "| backdoor | notes |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (method, mode, attack, fraction, defence), runs in groups.items():
        cells = [mean_and_delta(rows, runs, metric) for metric in ("accuracy", "last5")]
        notes = ", ".join(f"{k} {len(v) if isinstance(v, list) else v}" for k, v in runs[0].items()
                          if k in ("refused", "screened", "discarded_groups"))
        lines.append(f"| {method} | {mode} | {attack} | {100 * fraction:.0f} % | {defence} | {len(runs)} | "
                     f"{' | '.join(cells)} | {100 * np.mean([r['backdoor'] for r in runs]):.1f} | {notes} |")
    return "\n".join(lines)


def mean_and_delta(rows: list[dict], runs: list[dict], metric: str) -> str:
    """"mean | paired difference to the honest runs" of ``metric`` over ``runs`` (empty cells without it)."""
    if any(metric not in r for r in runs):
        return " | "
    honest = {(r["method"], r["mode"], r["defence"], r.get("seed", 0)): r[metric]
              for r in rows if r["attack"] == "honest" and metric in r}
    deltas = [100 * (r[metric] - honest[key]) for r in runs
              if (key := (r["method"], r["mode"], r["defence"], r.get("seed", 0))) in honest]
    delta = "" if runs[0]["attack"] == "honest" or not deltas else f"{np.mean(deltas):+.1f}" + (
        f" [{min(deltas):+.1f}, {max(deltas):+.1f}]" if len(deltas) > 1 else "")
    return f"{100 * np.mean([r[metric] for r in runs]):.1f} | {delta}"


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, a) for m, attacks in (("fed3r", FED3R_ATTACKS), ("fedavg", FEDAVG_ATTACKS)) for a in attacks]
    fig, axes = plt.subplots(2, 5, figsize=(20, 7), sharey=True)
    for ax, (method, attack) in zip(axes.ravel(), panels):
        defences = FED3R_DEFENCES if method == "fed3r" else FEDAVG_DEFENCES
        for i, defence in enumerate(defences):
            by_fraction: dict[float, list[float]] = {}          # the mean over seeds
            for r in rows:
                if (r["method"], r["mode"], r["attack"], r["defence"]) == (method, "plain", attack, defence):
                    by_fraction.setdefault(r["fraction"], []).append(r["accuracy"])
            if by_fraction:
                fractions = sorted(by_fraction)
                ax.plot([100 * f for f in fractions], [100 * np.mean(by_fraction[f]) for f in fractions],
                        marker="o", label=defence, color=f"C{i}")
            base = [r["accuracy"] for r in rows if (r["method"], r["mode"], r["attack"], r["defence"])
                    == (method, "plain", "honest", defence)]
            if base:
                ax.axhline(100 * np.mean(base), color=f"C{i}", linestyle=":", linewidth=1)
        ax.set_title(f"{method}: {attack}")
        ax.set_xlabel("malicious devices (%)")
        ax.legend(fontsize=7)
    axes[0, 0].set_ylabel("test accuracy (%)")
    axes[1, 0].set_ylabel("test accuracy (%)")
    fig.suptitle("Attacks vs defences on the demo fleet (dotted: honest-only run of each defence)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
