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
