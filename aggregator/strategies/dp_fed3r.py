"""Fed3R with the Gaussian mechanism on the summed statistics (central DP).

A device's contribution is bounded on the device (``edge_client.fed3r``): at most N samples, each
feature row z clipped to ‖z‖ ≤ F before the constant-1 bias feature is appended, so every row has
‖z‖² ≤ R² = F² (+ 1 with the intercept). Then

    ‖A_k‖_F = ‖Σ_i z_i z_iᵀ‖_F ≤ Σ_i ‖z_i‖² ≤ N R²,     ‖b_k‖_F = ‖Σ_i z_i y_iᵀ‖_F ≤ Σ_i ‖z_i‖ ≤ N R

(y_i one-hot), and the packed upper triangle holds each entry of A_k at most once, so adding or
removing one device moves the vector (packed A, B) by at most Δ = N R √(R² + 1) in L2
(docs/algorithms.md). :func:`check_bounded` refuses a contribution beyond these norms, so the
bound holds whatever the device did.

Each round's sum gets independent noise N(0, (zΔ)²) on every entry of the packed A and of B and is
then added to the released sums; the model is solved from released sums only. A device is in
one round, so every model the job publishes is post-processing of noisy sums each device
touched once (parallel composition): the job is a single Gaussian release with multiplier z.
The noisy A may not be positive semi-definite; :meth:`NoisyFed3R.solve` projects it onto the PSD
cone (eigenvalues clipped at 0) before the ridge solve — post-processing, free of privacy cost.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from protocols.payloads.fed3r import Fed3RStats

from aggregator.compute.ridge import ClosedFormRidge
from aggregator.strategies.fed3r import Fed3R


def row_norm_bound(feature_clip_norm: float, fit_intercept: bool) -> float:
    """R: the largest ‖z‖ of a row after clipping the features to F and appending the bias 1."""
    return math.sqrt(feature_clip_norm ** 2 + (1.0 if fit_intercept else 0.0))


def fed3r_sensitivity(max_samples: int, feature_clip_norm: float, fit_intercept: bool) -> float:
    """Δ = N R √(R² + 1): the L2 sensitivity of (packed A, B) to one device."""
    r = row_norm_bound(feature_clip_norm, fit_intercept)
    return max_samples * r * math.sqrt(r * r + 1.0)


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
    else:
        a_norm = float(np.linalg.norm(stats.a_upper))
        b_norm = float(np.linalg.norm(stats.b))
    if a_norm > stats.n * r2 * slack or b_norm > stats.n * math.sqrt(r2) * slack:
        raise ValueError(f"statistics exceed the clipped bound (‖A‖={a_norm:.4g}, ‖b‖={b_norm:.4g} for "
                         f"n={stats.n}, F={feature_clip_norm}): features not clipped on the device")


class NoisyFed3R:
    """Round sums (``pending``) noised into the released sums (``released``) at each round close."""

    def __init__(self, num_classes: int, p: int, lam: float, fit_intercept: bool, normalize_columns: bool,
                 noise_stddev: float, rng: np.random.Generator | None = None):
        if not (math.isfinite(noise_stddev) and noise_stddev > 0):
            raise ValueError(f"noise stddev must be a positive finite number, got {noise_stddev}")
        make = lambda: Fed3R(num_classes, p, lam, fit_intercept, normalize_columns)   # noqa: E731
        self.pending, self.released = make(), make()
        self.noise_stddev = float(noise_stddev)
        self.rng = rng if rng is not None else np.random.default_rng()
        self.releases = 0

    def add(self, stats: Fed3RStats) -> None:
        self.pending.add(stats)

    def positive_definite(self, a: np.ndarray, tau: float) -> bool:
        return self.pending.positive_definite(a, tau)

    def add_noised(self, a_upper: np.ndarray, b_dense: np.ndarray, n: int, contributions: int) -> None:
        """A sum that already carries its noise (distributed DP under SecAgg) joins the released sums."""
        self.released.add_dense(a_upper, b_dense, n)
        self.released.n_contributions += contributions - 1          # add_dense counted the sum as one
        self.releases += 1

    def release(self) -> None:
        """Noise the round's sum into the released sums; a round with nothing is not released."""
        if not self.pending.n_contributions:
            return
        p = self.pending
        packed = p.packed_upper()
        noisy_a = packed + self.rng.normal(0.0, self.noise_stddev, packed.shape)
        noisy_b = p.B.cpu().numpy() + self.rng.normal(0.0, self.noise_stddev, tuple(p.B.shape))
        self.pending = Fed3R(p.num_classes, p.p, p.lam, p.fit_intercept, p.normalize_columns)
        self.add_noised(noisy_a, noisy_b.T, p.n_samples, p.n_contributions)

    @property
    def n_contributions(self) -> int:
        return self.released.n_contributions

    @property
    def n_samples(self) -> int:
        return self.released.n_samples

    def solve(self) -> ClosedFormRidge:
        r = self.released
        eigenvalues, vectors = torch.linalg.eigh(r.A)
        psd = (vectors * eigenvalues.clamp(min=0.0)) @ vectors.T
        model = ClosedFormRidge(r.lam, r.fit_intercept, r.normalize_columns, device=str(r.device))
        return model.fit_statistics(psd, r.B)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**self.released.state_dict(), "dp_releases": np.array([self.releases], dtype=np.int64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.released.load_state_dict(state)
        self.releases = int(state["dp_releases"][0])
