"""A plain-numpy reference of ``ssp``'s solve (aggregator/strategies/dp_fed3r.py's docstring), for
the tests that check the job's released model against it."""

import math

import numpy as np


def spiked_wigner_shrinkage(a: np.ndarray, sigma_off: float, releases: int = 1) -> np.ndarray:
    """A with its eigenvalues μ > E = 2σ_o√(p·k) mapped to (μ + √(μ² − E²))/2 and the rest replaced
    by their mean (at least 0), written from the formulas, one eigenvalue at a time."""
    p = a.shape[0]
    edge = 2.0 * sigma_off * math.sqrt(p * releases)
    w, v = np.linalg.eigh(a)
    bulk = [mu for mu in w if mu <= edge]
    bulk_mean = max(0.0, sum(bulk) / len(bulk)) if bulk else 0.0
    shrunk = [(mu + math.sqrt(mu * mu - edge * edge)) / 2 if mu > edge else bulk_mean for mu in w]
    return (v * np.array(shrunk)) @ v.T


def ssp_weights(a: np.ndarray, b: np.ndarray, sigma_off: float, lam: float, releases: int = 1) -> np.ndarray:
    """The unnormalised ridge weights ``ssp`` solves for: (shrunk A + λ_ssp I)⁻¹ B, λ_ssp = max(λ, 2E/(3π))."""
    p = a.shape[0]
    ssp_lam = max(lam, 2 / (3 * math.pi) * 2 * sigma_off * math.sqrt(p * releases))
    return np.linalg.solve(spiked_wigner_shrinkage(a, sigma_off, releases) + ssp_lam * np.eye(p), b)


GRID_MARGIN = 2.0 ** -20        # the release grid's share of the sensitivity (aggregator/strategies/dp_noise.py)


def release_noise(scale, p: int, C: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(A's noise as a symmetric p×p matrix, B's noise p×C) of one DP Fed3R release, off the grid:
    σ_i(1 + 2^-20)·Z with the standard normals drawn in one call, A's packed triangle first, then B
    row by row. The release itself is within one grid step of the sums plus this, g ≤ Δ·2^-20 of
    the entry's block (:func:`grid_tolerance`)."""
    iu = np.triu_indices(p)
    z = rng.normal(size=len(iu[0]) + p * C)
    e = np.where(iu[0] == iu[1], scale.a_diagonal, scale.a_off_diagonal) * (1 + GRID_MARGIN) * z[:len(iu[0])]
    E = np.zeros((p, p))
    E[iu] = e
    return E + np.triu(E, 1).T, scale.b * (1 + GRID_MARGIN) * z[len(iu[0]):].reshape(p, C)


def grid_tolerance(sensitivity) -> tuple[float, float]:
    """(A's, B's) bound on how far the grid's rounding moves an entry: Δ·2^-20 ≥ g√d ≥ g."""
    return sensitivity.a * GRID_MARGIN, sensitivity.b * GRID_MARGIN
