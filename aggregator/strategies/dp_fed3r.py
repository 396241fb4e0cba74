"""Fed3R with a Gaussian mechanism on the summed statistics (central DP), two of them.

A device's contribution is bounded on the device (``edge_client.fed3r``): each feature row z is
clipped to ‖z‖ ≤ F before the constant-1 bias feature is appended, so every row has
‖z‖² ≤ R² = F² (+ 1 with the intercept), and the device uses at most N samples (its first N). So

    ‖A_k‖_F ≤ N R² = Δ_A,     ‖b_k‖_F ≤ N R = Δ_B

(y_i one-hot; :func:`check_bounded` refuses a contribution beyond these norms, so the bounds
hold whatever the device did).

Each round's sum gets independent noise, on the release grid (``dp_noise.grid_gaussian_release``),
and is then added to the released sums; the model is solved from released sums only. A device is
in one round, so every model the job publishes is post-processing of noisy sums each device
touched once (parallel composition): the job is one Gaussian release. A mechanism (:class:`Fed3RMechanism`) says how that release's noise is spread
over the entries and how the model is solved; its noise multiplier z is the Gaussian mechanism's
of the whole release (noise of unit variance on entries scaled by their stddev, whose
sensitivity is 1/z: :meth:`NoiseScale.noise_multiplier`).

- ``gaussian`` (:class:`UniformGaussian`): N(0, (zΔ)²) on every entry of the packed A and of B,
  Δ = √(Δ_A² + Δ_B²); λ the job's; RDP accounting.
- ``ssp`` (:class:`CalibratedSSP`, sufficient-statistics perturbation calibrated per block, the
  default): N(0, σ_A²) on A's diagonal and N(0, σ_A²/2) off it (A's Frobenius norm counts each
  off-diagonal entry twice, so the symmetric noise matrix is Analyze Gauss with half the
  variance off the diagonal at the same sensitivity), N(0, σ_B²) on B, with the release's budget
  split between the blocks: σ_A = zΔ_A/√(1−s), σ_B = zΔ_B/√s. λ is chosen from the noise alone
  (no privacy cost): the mean eigenvalue the noise leaves after the PSD projection; PLD
  accounting (exact for one Gaussian release). Under secure aggregation (Fed3R-Sync's
  distributed DP) the same per-block noise is :class:`DistributedSSP`: the devices scale their
  vector's blocks before adding one stddev, the aggregator scales the sum back; RDP accounting.

The noisy A may not be positive semi-definite: ``solve`` replaces its eigenvalues before the ridge
solve — post-processing, free of privacy cost. ``gaussian`` clips them at 0 (the PSD projection).
``ssp`` shrinks them as the spiked Wigner model says (Benaych-Georges & Nadakuditi 2011; Donoho,
Gavish & Johnstone 2018): the symmetric noise has a semicircle spectrum on [−E, E], E = 2σ_o√p
(√k times that after k releases), and a direction of A holding θ > E/2 shows up at
μ = θ + E²/(4θ) > E. So an eigenvalue μ > E is mapped back to θ = (μ + √(μ² − E²))/2, and the
bulk μ ≤ E, where signal and noise cannot be told apart direction by direction, is replaced by its
mean (at least 0): the noise's trace is about 0, so that mean is the bulk's mean signal. On the
fleet of bench/dp_fleet_scale.py (seed 1, ε = 1, p = 1281: 48 of A's eigenvalues above E) this
keeps 0.5 points the PSD projection lost.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from protocols.payloads.fed3r import Fed3RStats, packed_diagonal

from aggregator.compute.ridge import ClosedFormRidge
from aggregator.compute.privacy import UNPUBLISHED_PREFIX
from aggregator.strategies.dp_center import PrivateFeatureCenter, uncentred
from aggregator.strategies.dp_noise import (CENTER_RELEASE, MODEL_RELEASE, NoiseSource, grid_gaussian_release_all,
                                            noise_for, noise_source)
from aggregator.strategies.fed3r import Fed3R

# torch is imported where it is used, not here: the job registry imports this module, and a
# command that only checks a config (or prints its help) must not pay torch's import (~1.3 s).
if TYPE_CHECKING:
    import torch


def row_norm_bound(feature_clip_norm: float, fit_intercept: bool) -> float:
    """R: the largest ‖z‖ of a row after clipping the features to F and appending the bias 1."""
    return math.sqrt(feature_clip_norm ** 2 + (1.0 if fit_intercept else 0.0))


@dataclass(frozen=True)
class Fed3RSensitivity:
    """How far one device moves A (Frobenius norm) and B: Δ_A = N R², Δ_B = N R."""

    a: float
    b: float

    @classmethod
    def of(cls, max_samples: int, feature_clip_norm: float, fit_intercept: bool) -> "Fed3RSensitivity":
        r = row_norm_bound(feature_clip_norm, fit_intercept)
        return cls(max_samples * r * r, max_samples * r)

    @property
    def joint(self) -> float:
        """Δ = √(Δ_A² + Δ_B²) = N R √(R² + 1): the L2 sensitivity of (packed A, B)."""
        return math.hypot(self.a, self.b)


def fed3r_sensitivity(max_samples: int, feature_clip_norm: float, fit_intercept: bool) -> float:
    """Δ = N R √(R² + 1): the L2 sensitivity of (packed A, B) to one device."""
    return Fed3RSensitivity.of(max_samples, feature_clip_norm, fit_intercept).joint


def packed_frobenius(upper: np.ndarray, p: int) -> float:
    """‖A‖_F of the symmetric p×p A whose upper triangle ``upper`` holds row by row (each off-diagonal
    entry once: the packed vector's own norm is up to √2 smaller, which would let a crafted dense
    upload past the sensitivity the noise is calibrated to)."""
    rows = np.arange(p)
    diagonal = upper[rows * p - rows * (rows - 1) // 2]
    return math.sqrt(max(2.0 * float(upper @ upper) - float(diagonal @ diagonal), 0.0))


def check_bounded(stats: Fed3RStats, max_samples: int, feature_clip_norm: float, fit_intercept: bool) -> None:
    """ValueError unless a contribution is within the bounds the sensitivity assumes."""
    if stats.n > max_samples:
        raise ValueError(f"{stats.n} samples exceed the job's cap of {max_samples}")
    r2 = row_norm_bound(feature_clip_norm, fit_intercept) ** 2
    slack = 1 + 1e-9                                         # float64 rounding of the device's sums
    if stats.r_factor is not None:                           # A_k = RᵀR, b_k = Rᵀ QtY: ‖RᵀR‖_F = ‖RRᵀ‖_F (n×n, cheap)
        R = np.asarray(stats.r_factor, dtype=np.float64)
        a_norm = float(np.linalg.norm(R @ R.T))
        b_norm = float(np.linalg.norm(R.T @ np.asarray(stats.qty, dtype=np.float64)))
    else:                                                    # ‖A‖_F from the packed triangle: off-diagonals twice
        a_norm = packed_frobenius(np.asarray(stats.a_upper, dtype=np.float64), stats.p)
        b_norm = float(np.linalg.norm(stats.b))
    if a_norm > stats.n * r2 * slack or b_norm > stats.n * math.sqrt(r2) * slack:
        raise ValueError(f"statistics exceed the clipped bound (‖A‖={a_norm:.4g}, ‖b‖={b_norm:.4g} for "
                         f"n={stats.n}, F={feature_clip_norm}): features not clipped on the device")


def packed_per_entry(p: int, diagonal: float, off_diagonal: float) -> np.ndarray:
    """One number per entry of A's packed upper triangle: ``diagonal`` on its diagonal."""
    packed = np.full(p * (p + 1) // 2, off_diagonal)
    packed[packed_diagonal(p)] = diagonal
    return packed


@dataclass(frozen=True)
class NoiseScale:
    """The stddev of one release's noise on each kind of entry: A's diagonal, A's off-diagonal, B."""

    a_diagonal: float
    a_off_diagonal: float
    b: float

    def __post_init__(self):
        for name in ("a_diagonal", "a_off_diagonal", "b"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"noise stddev {name} must be a positive finite number, got {value}")

    @classmethod
    def uniform(cls, stddev: float) -> "NoiseScale":
        return cls(stddev, stddev, stddev)

    def noise_multiplier(self, sensitivity: Fed3RSensitivity) -> float:
        """z of the release as one Gaussian mechanism: divide every entry by its stddev (unit noise);
        one device then moves the vector by at most √(Σ_ii A_ii²/σ_d² + Σ_i<j A_ij²/σ_o² + ‖B‖²/σ_B²)
        ≤ √(Δ_A²/min(σ_d², 2σ_o²) + Δ_B²/σ_B²), since ‖A‖_F² = Σ A_ii² + 2 Σ_i<j A_ij²; z is its inverse."""
        a_scale = min(self.a_diagonal, math.sqrt(2.0) * self.a_off_diagonal)
        return 1.0 / math.hypot(sensitivity.a / a_scale, sensitivity.b / self.b)

    def spectral_edge(self, p: int, releases: int = 1) -> float:
        """2σ_o√p: where the spectrum of the symmetric noise matrix ends (Wigner's semicircle); the
        sum of ``releases`` independent draws has √releases times the stddev."""
        return 2.0 * self.a_off_diagonal * math.sqrt(p * max(releases, 1))

    def release(self, a_upper: np.ndarray, b: np.ndarray, sensitivity: Fed3RSensitivity,
                rng: NoiseSource) -> tuple[np.ndarray, np.ndarray]:
        """(packed A, B (p × C)) with this noise added, as one release on the grid
        (``dp_noise.grid_gaussian_release``). Each block's entries are given the block's own
        sensitivity: Δ_A on A's diagonal, Δ_A/√2 off it (the packed triangle holds each off-diagonal
        entry once, half its weight in ‖A‖_F²), Δ_B on B. The mean of (Δ_i/σ_i)² over the d entries is
        then at most 1/z² (:meth:`noise_multiplier`'s bound, each block's share weighted by its count
        ≤ d), what the grid's rule needs."""
        p = b.shape[0]
        stddev = {"a": packed_per_entry(p, self.a_diagonal, self.a_off_diagonal), "b": self.b}
        share = {"a": packed_per_entry(p, sensitivity.a, sensitivity.a / math.sqrt(2.0)), "b": sensitivity.b}
        released = grid_gaussian_release_all({"a": a_upper, "b": b}, stddev, share, rng)
        return released["a"], released["b"]


class Fed3RMechanism(ABC):
    """One DP Fed3R mechanism: the noise of the (single) release, how it is accounted, and the
    model solved from the released sums."""

    name: ClassVar[str]
    accounting: ClassVar[str]          # aggregator.compute.privacy's accountant for its z

    def __init__(self, noise_multiplier: float, sensitivity: Fed3RSensitivity):
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ValueError(f"noise multiplier must be a positive finite number, got {noise_multiplier}")
        self.noise_multiplier, self.sensitivity = float(noise_multiplier), sensitivity

    @abstractmethod
    def scale(self) -> NoiseScale:
        """The stddevs of the noise on the sum; their ``noise_multiplier`` is this mechanism's z."""

    @abstractmethod
    def regulariser(self, p: int, lam: float, releases: int = 1) -> float:
        """λ of the ridge solve, from the job's λ and the noise of ``releases`` releases (never the data)."""

    def shrunk(self, eigenvalues: torch.Tensor, releases: int) -> torch.Tensor:
        """The eigenvalues the solve uses for the released A's: clipped at 0 (the PSD projection)."""
        return eigenvalues.clamp(min=0.0)

    def denoised(self, a: torch.Tensor, releases: int = 1) -> torch.Tensor:
        """The released A with its eigenvalues :meth:`shrunk`: positive semi-definite, post-processing."""
        import torch

        eigenvalues, vectors = torch.linalg.eigh(a)
        return (vectors * self.shrunk(eigenvalues, releases)) @ vectors.T

    def solve(self, released: Fed3R, releases: int = 1) -> ClosedFormRidge:
        """The ridge solution of the released sums (``releases`` noise draws in them), A :meth:`denoised`."""
        model = ClosedFormRidge(self.regulariser(released.p, released.lam, releases), released.fit_intercept,
                                released.normalize_columns, device=str(released.device))
        return model.fit_statistics(self.denoised(released.A, releases), released.B)


class UniformGaussian(Fed3RMechanism):
    """N(0, (zΔ)²) on every entry of (packed A, B); the job's λ (the mechanism of issue 25)."""

    name, accounting = "gaussian", "rdp"

    def scale(self) -> NoiseScale:
        return NoiseScale.uniform(self.noise_multiplier * self.sensitivity.joint)

    def regulariser(self, p: int, lam: float, releases: int = 1) -> float:
        return lam


class CalibratedSSP(Fed3RMechanism):
    """Sufficient-statistics perturbation calibrated per block (module docstring): half the variance
    off A's diagonal, a share ``b_share`` of the budget on B, λ from the noise."""

    name, accounting = "ssp", "pld"
    # the mean of max(0, μ) for μ on the semicircle [−E, E] is 2E/(3π): the eigenvalue the PSD
    # projection leaves, on average, in a direction that holds noise only. λ of that size damps
    # such directions as much as the noise itself inflates them, and no more (no data consulted).
    EDGE_FRACTION = 2.0 / (3.0 * math.pi)

    def __init__(self, noise_multiplier: float, sensitivity: Fed3RSensitivity, b_share: float = 0.2):
        super().__init__(noise_multiplier, sensitivity)
        if not 0 < b_share < 1:
            raise ValueError(f"b_share must lie in (0, 1), got {b_share}")
        self.b_share = float(b_share)

    def scale(self) -> NoiseScale:
        z, s = self.noise_multiplier, self.b_share
        sigma_a = z * self.sensitivity.a / math.sqrt(1.0 - s)
        return NoiseScale(sigma_a, sigma_a / math.sqrt(2.0), z * self.sensitivity.b / math.sqrt(s))

    def regulariser(self, p: int, lam: float, releases: int = 1) -> float:
        return max(lam, self.EDGE_FRACTION * self.scale().spectral_edge(p, releases))

    def shrunk(self, eigenvalues: torch.Tensor, releases: int) -> torch.Tensor:
        """Spiked-Wigner shrinkage (module docstring): θ = (μ + √(μ² − E²))/2 above the noise's edge
        E, the bulk's mean (at least 0) at or below it."""
        import torch

        edge = self.scale().spectral_edge(eigenvalues.shape[0], releases)
        spikes = eigenvalues > edge
        bulk = eigenvalues[~spikes]
        bulk_mean = bulk.mean().clamp(min=0.0) if bulk.numel() else eigenvalues.new_zeros(())
        debiased = (eigenvalues + torch.sqrt((eigenvalues ** 2 - edge ** 2).clamp(min=0.0))) / 2.0
        return torch.where(spikes, debiased, bulk_mean)


class DistributedSSP(CalibratedSSP):
    """``ssp`` under secure aggregation (Fed3R-Sync's distributed DP): the same per-block noise,
    made by the devices from one Skellam stddev σ_A on every entry (``protocols/secagg/
    distributed_dp.py``): each scales its vector's blocks first (:meth:`block_scales`: A's
    off-diagonal entries by σ_A/σ_o = √2, B by σ_A/σ_B), and the aggregator divides the sum back,
    leaving σ_o off A's diagonal and σ_B on B. RDP accounting, as for every distributed-noise job
    (the bound that lets the Skellam sum be accounted as a Gaussian, Agarwal, Kairouz & Liu 2021,
    is a Rényi-DP statement)."""

    name, accounting = "ssp-distributed", "rdp"

    def block_scales(self) -> tuple[float, float]:
        """(A's off-diagonal, B) scales that turn one stddev σ_A into this mechanism's per-block noise."""
        scale = self.scale()
        return scale.a_diagonal / scale.a_off_diagonal, scale.a_diagonal / scale.b


MECHANISMS: dict[str, type[Fed3RMechanism]] = {m.name: m for m in (UniformGaussian, CalibratedSSP)}
DP_RELEASES = ("round", "end")      # when a job's round sums are released (NoisyFed3R.release_at_end)


class NoisyFed3R:
    """Round sums (``pending``) noised into the released sums (``released``) at each round close.

    ``release_at_end``: a closed round's exact sum joins the ``held`` sums instead, and the job
    noises them once, when it ends (:meth:`release_held`). Every device is still in one noisy sum
    (the same z), but the model then holds one release's noise variance however many rounds and
    retries the job ran, where releasing each round leaves k rounds' k times that; the price is
    no model, and no accuracy to report, until the job ends."""

    def __init__(self, num_classes: int, p: int, lam: float, fit_intercept: bool, normalize_columns: bool,
                 mechanism: Fed3RMechanism, rng: NoiseSource | None = None,
                 center: PrivateFeatureCenter | None = None, release_at_end: bool = False):
        make = lambda: Fed3R(num_classes, p, lam, fit_intercept, normalize_columns)   # noqa: E731
        self.pending, self.released, self.held = make(), make(), make()
        self.mechanism = mechanism
        self.rng = rng if rng is not None else noise_source()
        self.releases = 0
        # the released sums' noise variance in units of one release's: a distributed-DP group of s
        # survivors at threshold t carries s/t of it (each member adds σ²/t), 1.5 with none dropped;
        # the denoising's spectral edge and λ read this, not the count (the edge was √1.5 too small)
        self.noise_units = 0.0
        self.center = center            # first the center round, then rounds of centred rows (dp_center.py)
        self.release_at_end = release_at_end

    @property
    def centering(self) -> bool:
        """The round in progress is the center round: its sums feed the center, not the model."""
        return self.center is not None and not self.center.released

    def add(self, stats: Fed3RStats) -> None:
        (self.center if self.centering else self.pending).add(stats)

    def take_round_sum(self, state: dict[str, np.ndarray] | None) -> None:
        """The round's sum of statistics as a Fed3R state added up the canonical bucket tree (one
        aggregator's stored round, or its shards'; None: nothing), in place of what :meth:`add`
        summed in arrival order: the release is then a function of which devices took part only,
        the same bits however many shards summed it."""
        if self.centering:
            self.center.take_sum(state)
            return
        self.pending = self._empty_round_sum()
        if state is not None:
            self.pending.load_state_dict(state)

    def _empty_round_sum(self) -> Fed3R:
        p = self.pending
        return Fed3R(p.num_classes, p.p, p.lam, p.fit_intercept, p.normalize_columns)

    def positive_definite(self, a: np.ndarray, tau: float) -> bool:
        return self.pending.positive_definite(a, tau)

    def add_noised(self, a_upper: np.ndarray, b_dense: np.ndarray, n: int, contributions: int,
                   noise_units: float = 1.0) -> None:
        """A sum that already carries its noise (distributed DP under SecAgg: ``noise_units`` times a
        release's variance) joins the released sums."""
        _add_sum(self.released, a_upper, b_dense, n, contributions)
        self.releases += 1
        self.noise_units += noise_units

    def release(self) -> None:
        """The round closes: its sum is noised into the released sums (or, ``release_at_end``, held
        exactly until the job ends); a round with nothing is not released."""
        if self.centering:
            self.center.release(noise_for(self.rng, CENTER_RELEASE))
            return
        if not self.pending.n_contributions:
            return
        p, self.pending = self.pending, self._empty_round_sum()
        if self.release_at_end:
            _add_sum(self.held, p.packed_upper(), p.B.cpu().numpy().T, p.n_samples, p.n_contributions)
        else:
            self._noise_into_released(p)

    def release_held(self) -> bool:
        """The job ends (``release_at_end``): the held sums of every closed round, noised once, join
        the released sums. Returns whether anything was released (nothing held: nothing)."""
        if not self.held.n_contributions:
            return False
        self._noise_into_released(self.held)
        self.held = self._empty_round_sum()     # only once released: a failed draw keeps them
        return True

    def _noise_into_released(self, sums: Fed3R) -> None:
        noisy_a, noisy_b = self.mechanism.scale().release(sums.packed_upper(), sums.B.cpu().numpy(),
                                                          self.mechanism.sensitivity,
                                                          noise_for(self.rng, MODEL_RELEASE, self.releases))
        self.add_noised(noisy_a, noisy_b.T, sums.n_samples, sums.n_contributions)

    @property
    def unreleased(self) -> bool:
        """Closed rounds' sums are held, not yet released: there is no model to report."""
        return self.held.n_contributions > 0

    @property
    def n_contributions(self) -> int:
        """Devices whose statistics the model holds, or will hold once the held sums are released."""
        return self.released.n_contributions + self.held.n_contributions

    @property
    def n_samples(self) -> int:
        return self.released.n_samples + self.held.n_samples

    def solve(self) -> ClosedFormRidge:
        model = self.mechanism.solve(self.released, self.noise_units)
        return model if self.center is None or not self.center.released else uncentred(model, self.center.value)

    def state_dict(self) -> dict[str, np.ndarray]:
        center = {} if self.center is None else self.center.state_dict()
        # the held sums are exact: checkpointed, never published (UNPUBLISHED_PREFIX)
        held = {HELD + k: v for k, v in self.held.sums_state().items()} if self.release_at_end else {}
        return {**self.released.state_dict(), **center, **held,
                "dp_releases": np.array([self.releases], dtype=np.int64),
                "dp_noise_units": np.array([self.noise_units], dtype=np.float64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.released.load_state_dict(state)
        self.releases = int(state["dp_releases"][0])
        # a checkpoint from before noise_units: each release counted as one (what solve then assumed)
        self.noise_units = float(state["dp_noise_units"][0]) if "dp_noise_units" in state else float(self.releases)
        if self.center is not None:
            self.center.load_state_dict(state)
        self.held = self._empty_round_sum()
        if self.release_at_end and HELD + "counts" in state:
            self.held.load_state_dict({k[len(HELD):]: v for k, v in state.items() if k.startswith(HELD)})


HELD = UNPUBLISHED_PREFIX + "dp_held_"


def _add_sum(target: Fed3R, a_upper: np.ndarray, b_dense: np.ndarray, n: int, contributions: int) -> None:
    """``target`` += one sum of ``contributions`` devices' statistics (A's packed triangle, a dense
    C×p b and n samples)."""
    target.add_dense(a_upper, b_dense, n)
    target.n_contributions += contributions - 1          # add_dense counted the sum as one
