"""DP Fed3R where it pays: test accuracy at ε ∈ {1, 2, 4, 8} (δ = 1/N) against no DP, for
cross-device fleets of 10,000 and 100,000 devices (issue 25, item 4), for both of the job's
mechanisms (issue 38, item 4: ε = 1 within 2 points of no DP, ε = 4 within 1 point).

The fleets are the ``fleet-10k`` / ``fleet-100k`` shape: each device draws a long-tailed number of
Fashion-MNIST training images (1 to 50, about 5 on average, label-skewed as Dir(0.1);
``fedfleet.emulation.partition.split_long_tailed``), so images repeat across devices.
Features: MobileNetV2 at 32 px (eager, cached in .cache/features).

What runs is the job's own mechanism, not a re-implementation: every device clips its rows to
F and weighs them to at most N in all (each of its n rows by min(1, N/n): ``cap_by_weight``,
``edge_client.fed3r``'s rule; ``--first-rows``: its first N, the rule before), the fleet's sum is handed to the
DP strategy (``aggregator.strategies.dp_fed3r.NoisyFed3R``) with the job's mechanism, which
noises the sum and solves on its denoised A (gaussian: the PSD projection; ssp: spiked-Wigner
shrinkage); z is the smallest noise multiplier the mechanism's accountant (dp-accounting)
allows for one release at (ε, δ) (``noise_multiplier_for``).

- ``gaussian`` (issue 25's): N(0, (zΔ)²) on every entry, RDP accounting, N = ``--cap`` (10),
  λ = max(0.01, 2σ√p) (the noise matrix's spectral norm), as in bench/dp_accuracy.py.
- ``ssp+center``: ``ssp`` with the job's private feature center (``dp_center_devices`` m =
  ``--center-devices``, ``dp_center_clip_norm`` F_c = ``--center-clip``): m devices release the
  mean of their rows clipped to F, the others clip their rows minus that mean to F_c
  (aggregator/strategies/dp_center.py).
- ``ssp`` (the default): per-block noise (half the variance off A's diagonal, ``--b-share`` of
  the budget on B), λ from the noise, PLD accounting, N = ``--ssp-cap`` (1: the per-device bound
  that maximises signal over noise when the fleet is this large, see docs/algorithms.md).
- ``ssp-secure``: what Fed3R-Sync releases under secure aggregation with distributed DP: every
  device scales its vector's blocks (the task's ``block_scales``) and adds Skellam noise in the
  ring, one stddev on every entry, which the aggregator's scaling back turns into ``ssp``'s
  per-block noise; RDP accounting (z larger than PLD's), ssp's λ rule and shrinkage, N =
  ``--ssp-cap``; simulated as the Gaussian of those stddevs (the Skellam sum's variance, what
  its accounting uses).
- ``ssp-secure+center``: Fed3R-Sync with the private feature center (``dp_center_devices``): the
  center round a secure group whose members send (Σ z, n) with their noise shares (``center_round``
  tasks), RDP's multiplier, then ``ssp-secure`` on the centred rows.
  Both secure rows carry what the groups cost (``--secure-groups G``, ``secure_noise_factor``): each
  group is calibrated to its threshold t = ⌈2κ/3⌉, so with every member surviving a group's sum
  holds κ/t = 1.5 times the release's noise variance, and G groups G times that.

The fleet's sum is formed as Σ_i w_i z_i z_iᵀ over the distinct images i a device kept (w_i: how
many devices kept it) — the same sum in another order, which the wire path (tested elsewhere to
1e-12) would reach device by device. Nothing is tuned on the test set. The closing lines print
the goals' differences and, for ``ssp`` at ε = 1, where the points go: noise on A only, on B
only, and the same λ without noise (the regulariser's own cost); then, as a bound on what any λ
rule could give this mechanism, the best λ of a grid chosen on the test set (ε = 1 and 4).

    nice -n 10 .venv/bin/python bench/dp_fleet_scale.py [--fleets 10000 100000] [--cap 10] [--ssp-cap 1] [--clip 8]
    ... --fleets 100000 --seed 3 --project digits-pca --project-dims 768    # fewer noised entries, chosen publicly
    ... --fleets 100000 --seed 3 --noise-draws 8     # the +center rows over 8 noise draws (the expected accuracy)
    ... --fleets 100000 --seed 3 --noise-draws 4 --first-rows  # devices keeping their first N rows (the rule before stop 81)
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aggregator.compute.privacy import noise_multiplier_for  # noqa: E402
from aggregator.compute.ridge import ClosedFormRidge  # noqa: E402
from aggregator.strategies.dp_center import PrivateFeatureCenter  # noqa: E402
from protocols.secagg.config import threshold_at_least  # noqa: E402
from aggregator.strategies.dp_fed3r import (CalibratedSSP, Fed3RMechanism, Fed3RSensitivity, NoiseScale,  # noqa: E402
                                            DistributedSSP, NoisyFed3R, UniformGaussian)
from edge_client.data.idx import load_fashion_mnist  # noqa: E402
from edge_client.features import FeatureExtractor  # noqa: E402
from fedfleet.emulation.partition import split_long_tailed  # noqa: E402
from protocols.payloads.fed3r import Fed3RStats  # noqa: E402

EPSILONS = (1.0, 2.0, 4.0, 8.0)
C = 10


def features(split: str) -> tuple[np.ndarray, np.ndarray]:
    extractor = FeatureExtractor.eager("mobilenet_v2", image_size=32, batch_size=256,
                                       cache_dir=REPO / ".cache" / "features", threads=2)
    images, labels = load_fashion_mnist(split)
    return extractor.extract(images).astype(np.float64), labels.astype(np.int64)


def projection(kind: str, dims: int, p: int) -> np.ndarray:
    """A (p x dims) orthonormal basis chosen without the private data: the top principal directions
    of public features (scikit-learn's digits, 8x8 upscaled, through the same backbone), or seeded
    random directions."""
    if kind == "random":
        return np.linalg.qr(np.random.default_rng(12345).standard_normal((p, dims)))[0]
    from sklearn.datasets import load_digits

    images = (load_digits().images / 16 * 255).astype(np.uint8)
    public = FeatureExtractor.eager("mobilenet_v2", image_size=32, batch_size=256, threads=2).extract(images)
    _, vectors = np.linalg.eigh(np.cov(public.astype(np.float64).T))
    return vectors[:, ::-1][:, :dims]


def clip_rows(z: np.ndarray, bound: float) -> np.ndarray:
    norms = np.linalg.norm(z, axis=1, keepdims=True)
    return z * np.minimum(1.0, bound / np.maximum(norms, 1e-300))


def fleet_sums(z: np.ndarray, y: np.ndarray, parts: list[np.ndarray], cap: int | None,
               first_rows: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
    """(A, B, samples) of the fleet, bias appended: Σ over devices of all their rows (``cap`` None),
    or of their rows each weighed min(1, cap/n_k) (the devices' ``cap_by_weight``), or with
    ``first_rows`` of their first ``cap`` rows; samples is Σ min(n_k, cap) either way."""
    weights = np.zeros(len(z))
    for part in parts:
        if cap is None:
            np.add.at(weights, part, 1.0)
        elif first_rows:
            np.add.at(weights, part[:cap], 1.0)
        else:
            np.add.at(weights, part, min(1.0, cap / len(part)))
    za = np.hstack([z, np.ones((len(z), 1))])
    a = (za * weights[:, None]).T @ za
    b = (za * weights[:, None]).T @ np.eye(C)[y]
    return a, b, sum(len(p) if cap is None else min(len(p), cap) for p in parts)


def accuracy(a: np.ndarray, b: np.ndarray, lam: float, test: tuple[np.ndarray, np.ndarray]) -> float:
    model = ClosedFormRidge(lam, True, True, device="cpu").fit_statistics(torch.from_numpy(a), torch.from_numpy(b))
    return model.score(*test)


class FixedLambda(UniformGaussian):
    """Issue 25's bench rule for the gaussian mechanism: λ = max(0.01, 2σ√p)."""

    def regulariser(self, p: int, lam: float, releases: int = 1) -> float:
        return max(0.01, 2 * self.scale().a_diagonal * math.sqrt(p))


class Ablated(Fed3RMechanism):
    """ssp with some of its noise removed (tiny stddevs): where the points go. λ stays ssp's."""

    name, accounting = "ablated", "pld"

    def __init__(self, ssp: CalibratedSSP, keep_a: bool, keep_b: bool):
        super().__init__(ssp.noise_multiplier, ssp.sensitivity)
        self.ssp, self.keep_a, self.keep_b = ssp, keep_a, keep_b

    def scale(self) -> NoiseScale:
        s, tiny = self.ssp.scale(), 1e-12
        return NoiseScale(s.a_diagonal if self.keep_a else tiny, s.a_off_diagonal if self.keep_a else tiny,
                          s.b if self.keep_b else tiny)

    def regulariser(self, p: int, lam: float, releases: int = 1) -> float:
        return self.ssp.regulariser(p, lam, releases)


LAMBDA_GRID = (0.01, 0.03, 0.06, 0.1, 0.15, 2 / (3 * math.pi), 0.3, 0.5, 1.0)   # × the noise's spectral edge E


def best_lambda_on_test(sums, mechanism: CalibratedSSP, test, seed: int) -> tuple[float, float]:
    """(fraction of E, accuracy) of the λ that does best *on the test set* for this very release:
    an upper bound for any rule choosing λ of this mechanism (so never the job's choice)."""
    a, b, n = sums
    strategy = NoisyFed3R(C, a.shape[0], 0.01, True, True, mechanism, rng=np.random.default_rng(seed))
    strategy.pending.add_dense(a[np.triu_indices(a.shape[0])], b.T, n)
    strategy.release()
    r = strategy.released
    denoised = mechanism.denoised(r.A)
    edge = mechanism.scale().spectral_edge(a.shape[0])
    scores = [(ClosedFormRidge(c * edge, True, True, device="cpu").fit_statistics(denoised, r.B).score(*test), c)
              for c in LAMBDA_GRID]
    acc, c = max(scores)
    return c, acc


def secure_noise_factor(devices: int, groups: int, threshold: float = 0.0) -> float:
    """How much larger the stddev of Fed3R-Sync's summed noise is than one release's: each of the
    ``groups`` SecAgg groups (κ = devices/groups members, threshold t = ⌈2κ/3⌉, or the job's
    ``dp_group_threshold`` share of κ) is a release of its own whose members each add σ²/t, so
    with every member surviving the model holds groups·κ/t times σ² (protocols/secagg/distributed_dp.py)."""
    kappa = math.ceil(devices / max(groups, 1))
    return math.sqrt(groups * kappa / threshold_at_least(kappa, threshold))


def mechanism_for(kind: str, eps: float, delta: float, cap: int, clip: float, b_share: float,
                  noise_factor: float = 1.0) -> Fed3RMechanism:
    sensitivity = Fed3RSensitivity.of(cap, clip, True)
    if kind == "gaussian":
        return FixedLambda(noise_multiplier_for(eps, delta, 1, accounting="rdp"), sensitivity)
    if kind == "ssp-secure":     # noise_factor: the groups' (secure_noise_factor), as z grown by it
        return DistributedSSP(noise_multiplier_for(eps, delta, 1, accounting="rdp") * noise_factor, sensitivity,
                              b_share)
    return CalibratedSSP(noise_multiplier_for(eps, delta, 1, accounting="pld"), sensitivity, b_share)


def released_accuracy(a: np.ndarray, b: np.ndarray, n: int, mechanism: Fed3RMechanism, test, seed: int) -> float:
    strategy = NoisyFed3R(C, a.shape[0], 0.01, True, True, mechanism, rng=np.random.default_rng(seed))
    strategy.pending.add_dense(a[np.triu_indices(a.shape[0])], b.T, n)
    strategy.release()
    return strategy.solve().score(*test)


def centred_accuracy(ztr: np.ndarray, ytr: np.ndarray, parts: list[np.ndarray], eps: float, delta: float,
                     args, test, secure: bool = False, noise_seed: int | None = None) -> float:
    """``ssp`` with the job's private feature center (``dp_center_devices``): a seeded m of the fleet
    release the mean of their rows clipped to F, the others centre on it and clip to F_c; the
    model is solved and shifted back by the job's own classes (aggregator/strategies/dp_center.py).
    ``secure``: Fed3R-Sync's distributed form (RDP-accounted, ``DistributedSSP``; the center round's
    sum is a group sum of (Σ z, n) carrying the devices' noise of the same multiplier).
    ``noise_seed``: the noise draw (default ``--seed``); the fleet and the center's devices stay ``--seed``'s."""
    order = np.random.default_rng(args.seed + 1).permutation(len(parts))
    centre_parts, rest = [parts[i] for i in order[:args.center_devices]], [parts[i] for i in order[args.center_devices:]]
    z = noise_multiplier_for(eps, delta, 1, accounting="rdp" if secure else "pld")
    kind = DistributedSSP if secure else CalibratedSSP
    # under SecAgg: the center one group of m, the rest in --secure-groups groups (secure_noise_factor)
    model_factor = secure_noise_factor(len(rest), args.secure_groups, args.group_threshold) if secure else 1.0
    center_factor = secure_noise_factor(len(centre_parts), 1, args.group_threshold) if secure else 1.0
    mechanism = kind(z * model_factor, Fed3RSensitivity.of(args.ssp_cap, args.center_clip, True), args.b_share)
    p = ztr.shape[1] + 1
    center = PrivateFeatureCenter(C, p, z * center_factor, args.ssp_cap, args.clip)
    noise = np.random.default_rng(args.seed if noise_seed is None else noise_seed)
    strategy = NoisyFed3R(C, p, 0.01, True, True, mechanism, rng=noise, center=center)
    iu = np.triu_indices(p)
    a, b, n = fleet_sums(clip_rows(ztr, args.clip), ytr, centre_parts, args.ssp_cap, args.first_rows)
    strategy.add(Fed3RStats(n=n, p=p, a_upper=a[iu], class_ids=np.arange(C), b=b.T))
    strategy.release()                                   # the center round: only μ̂ is released
    a, b, n = fleet_sums(clip_rows(ztr - center.value, args.center_clip), ytr, rest, args.ssp_cap, args.first_rows)
    strategy.pending.add_dense(a[iu], b.T, n)
    strategy.release()
    return strategy.solve().score(*test)                 # raw test features: the bias absorbed μ̂


def centred_rows(ztr, ytr, parts, delta, args, test, secure: bool = False) -> list[float]:
    """The ssp+center row (``secure``: ssp-secure+center), each ε's accuracy the mean over
    ``--noise-draws`` noise draws (seeds ``--seed``, then 1000·seed + k), their spread printed."""
    seeds = [args.seed] + [1000 * args.seed + k for k in range(1, args.noise_draws)]
    draws = np.array([[centred_accuracy(ztr, ytr, parts, eps, delta, args, test, secure, s) for eps in EPSILONS]
                      for s in seeds])
    if len(seeds) > 1:
        print(f"{'':>8} {'':>9}  over {len(seeds)} noise draws: sd of one draw "
              + " ".join(f"{sd:>7.4f}" for sd in draws.std(axis=0, ddof=1)), flush=True)
    return list(draws.mean(axis=0))


def mechanism_rows(name: str, sums, mechanisms: list[Fed3RMechanism], test, seed: int) -> list[float]:
    accs = [released_accuracy(*sums, m, test, seed) for m in mechanisms]
    print(f"{'':>8} {name:>9}: " + " ".join(f"{acc:>7.3f}" for acc in accs) + "   z: "
          + ", ".join(f"{m.noise_multiplier:.2f}" for m in mechanisms), flush=True)
    return accs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleets", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--cap", type=int, default=10, help="N of the gaussian mechanism: samples a device keeps")
    ap.add_argument("--ssp-cap", type=int, default=1, help="N of the ssp mechanism")
    ap.add_argument("--clip", type=float, default=8.0, help="F: feature row clip norm (about the median norm)")
    ap.add_argument("--b-share", type=float, default=0.2, help="ssp: the share of the budget spent on B")
    ap.add_argument("--center-devices", type=int, default=2000,
                    help="ssp+center: devices of the center round (the job's dp_center_devices)")
    ap.add_argument("--center-clip", type=float, default=4.0,
                    help="ssp+center: F_c, the clip of the centred rows (about their median norm)")
    ap.add_argument("--secure-groups", type=int, default=1,
                    help="ssp-secure rows: the SecAgg groups the fleet is summed in (each a release whose members "
                         "add σ²/t each; the center is one more group of --center-devices)")
    ap.add_argument("--group-threshold", type=float, default=0.0,
                    help="secure rows: the job's dp_group_threshold (the share of a group that must survive; "
                         "0: SecAgg's ⌈2κ/3⌉)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise-draws", type=int, default=1,
                    help="the +center rows: the mean over this many noise draws of the same fleet (one release "
                         "each; the goals are read against the mechanism's expected accuracy)")
    ap.add_argument("--project", choices=("digits-pca", "random"),
                    help="first project the features (train and test) to --project-dims: onto the top principal "
                         "directions of public data (scikit-learn's digits through the same backbone), or a seeded "
                         "random orthonormal basis (scale --clip/--center-clip by √(d/p) yourself)")
    ap.add_argument("--project-dims", type=int, default=768)
    ap.add_argument("--first-rows", action="store_true",
                    help="devices keep their first N rows (the cap before cap_by_weight) instead of weighing all")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    (ztr, ytr), test = features("train"), features("test")
    unprojected = (ztr, test)
    if args.project:
        basis = projection(args.project, args.project_dims, ztr.shape[1])
        ztr, test = ztr @ basis, (test[0] @ basis, test[1])
        print(f"features projected to d = {args.project_dims} ({args.project})", flush=True)
    print(f"features: train {ztr.shape}, test {test[0].shape} ({time.perf_counter() - t0:.0f}s); "
          f"median row norm {np.median(np.linalg.norm(ztr, axis=1)):.2f}, F = {args.clip}, "
          f"N = {args.cap} (gaussian) / {args.ssp_cap} (ssp)", flush=True)
    clipped = clip_rows(ztr, args.clip)
    print(f"{'devices':>8} {'samples':>8} {'no DP':>7} " + " ".join(f"{'ε=' + str(e):>7}" for e in EPSILONS))
    summary = []
    for n_devices in args.fleets:
        parts = split_long_tailed(ytr, n_devices, alpha=0.1, seed=args.seed)
        a, b, n = fleet_sums(ztr, ytr, parts, None)
        plain = accuracy(a, b, 0.01, test)
        print(f"{n_devices:>8} {n:>8} {plain:>7.3f}", flush=True)
        if args.project:        # what the goals are read against: the model without DP and without the projection
            plain = accuracy(*fleet_sums(unprojected[0], ytr, parts, None)[:2], 0.01, unprojected[1])
            print(f"{'':>8} no DP on the unprojected features: {plain:.3f} (the differences below are from it)",
                  flush=True)
        delta = 1.0 / n_devices
        rows = {}
        for kind, cap in (("gaussian", args.cap), ("ssp", args.ssp_cap)):
            sums = fleet_sums(clipped, ytr, parts, cap, args.first_rows)
            mechanisms = [mechanism_for(kind, eps, delta, cap, args.clip, args.b_share) for eps in EPSILONS]
            print(f"{'':>8} {kind} N={cap}: {sums[2]} samples kept, no-DP accuracy on them "
                  f"{accuracy(sums[0], sums[1], 0.01, test):.3f}", flush=True)
            rows[kind] = mechanism_rows(kind, sums, mechanisms, test, args.seed)
        # under secure aggregation (Fed3R-Sync): the devices' Skellam noise on their block-scaled
        # vectors, RDP-accounted (DistributedSSP); simulated as the Gaussian of the sum's stddevs
        factor = secure_noise_factor(n_devices, args.secure_groups, args.group_threshold)
        secure = [mechanism_for("ssp-secure", eps, delta, args.ssp_cap, args.clip, args.b_share, factor)
                  for eps in EPSILONS]
        print(f"{'':>8} secure rows: {args.secure_groups} SecAgg group(s), threshold "
              f"{'⌈2κ/3⌉' if not args.group_threshold else f'{args.group_threshold}·κ'}, every member "
              f"surviving: the summed noise's stddev {factor:.2f}× one release's", flush=True)
        rows["ssp-secure"] = mechanism_rows("ssp-secure", sums, secure, test, args.seed)
        accs = centred_rows(ztr, ytr, parts, delta, args, test)
        print(f"{'':>8} {'ssp+center':>9}: " + " ".join(f"{acc:>7.3f}" for acc in accs)
              + f"   (m = {args.center_devices} devices release the mean at F = {args.clip}; F_c = {args.center_clip})",
              flush=True)
        rows["ssp+center"] = accs
        accs = centred_rows(ztr, ytr, parts, delta, args, test, secure=True)
        print(f"{'':>8} {'ssp-secure+center':>9}: " + " ".join(f"{acc:>7.3f}" for acc in accs), flush=True)
        rows["ssp-secure+center"] = accs
        ssp1 = mechanisms[0]
        ablations = {"A noise only": Ablated(ssp1, True, False), "B noise only": Ablated(ssp1, False, True),
                     "no noise (λ only)": Ablated(ssp1, False, False)}
        losses = {k: plain - released_accuracy(*sums, m, test, args.seed) for k, m in ablations.items()}
        oracles = [(eps, *best_lambda_on_test(sums, m, test, args.seed)) for eps, m in zip(EPSILONS, mechanisms)
                   if eps in (1.0, 4.0)]
        summary.append((n_devices, plain, rows, losses, oracles))
    for n_devices, plain, rows, losses, oracles in summary:
        for kind, accs in rows.items():
            print(f"{n_devices} devices, {kind}: ε=1 keeps {accs[0] / plain:.3f} of the no-DP accuracy "
                  f"({plain - accs[0]:+.3f} below; goal ≤ 0.02), ε=4 keeps {accs[2] / plain:.3f} "
                  f"({plain - accs[2]:+.3f} below; goal ≤ 0.01)")
        print(f"{n_devices} devices, ssp at ε=1, points lost to: " + ", ".join(f"{k} {v:+.3f}" for k, v in losses.items()))
        print(f"{n_devices} devices, the bound for ssp's λ rule (λ = 0.21 E): the best λ of the grid on the test "
              "set itself, same release: " + ", ".join(f"ε={e}: λ = {c:.2f} E → {acc:.3f} ({plain - acc:+.3f})"
                                                       for e, c, acc in oracles))
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
