"""FedNCM: the nearest-class-mean head from Fed3R's own sums (Legate et al. 2023; the Fed3R paper's Table 2 baseline).

Fed3R's statistic B = Σ_k Z_kᵀ Y_k already holds, with the bias column appended to Z (``fit_intercept``),
every class's feature sum s_c = Σ_k s_{k,c} (B's first d rows, column c) and its sample count
n_c = Σ_k n_{k,c} (B's last row, since the bias feature is 1). So FedNCM needs no upload of its
own: it is one more "solve" on the statistics a Fed3R job sums, exactly

    μ_c = s_c / n_c,        head:  w_c = μ_c / ‖μ_c‖,  b_c = 0,

a cosine-style classifier on the class means (a class no device has seen gets w_c = 0). A is
summed (and checked) as for Fed3R, because devices run the unchanged Fed3R task; it is not
used by the solve.
"""

from __future__ import annotations

import numpy as np

from aggregator.compute.ridge import LinearClassifier
from aggregator.strategies.fed3r import Fed3R


class NearestClassMeans(LinearClassifier):
    """The solved FedNCM head with ``ClosedFormRidge``'s read interface (``coef_``, ``intercept_``,
    ``raw_weights_``, ``score``), so a Fed3R job stores and evaluates it unchanged."""

    def __init__(self, sums: np.ndarray, counts: np.ndarray):
        sums, counts = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.float64)
        seen = counts > 0
        means = np.zeros_like(sums)
        means[:, seen] = sums[:, seen] / counts[seen]
        norms = np.linalg.norm(means, axis=0)
        weights = np.zeros_like(means)
        nonzero = norms > 0
        weights[:, nonzero] = means[:, nonzero] / norms[nonzero]
        self.means_ = means.T                                  # (C, d)
        self.counts_ = counts
        self.coef_ = weights.T.copy()                          # (C, d), like ClosedFormRidge
        self.intercept_ = np.zeros(len(counts))
        # what a Fed3R job stores as raw_weights: (p, C) with the counts as the last row
        self.raw_weights_ = np.vstack([means, counts[None, :]])
        self.n_features_in_ = sums.shape[0]
        self.classes_ = np.arange(len(counts))


class FedNCM(Fed3R):
    """Fed3R's accumulation (same statistics, same checks), solved as class means."""

    def __init__(self, num_classes: int, p: int, fit_intercept: bool = True, device: str = "auto"):
        if not fit_intercept:
            raise ValueError("FedNCM reads the class counts from the bias row of B: it needs fit_intercept")
        # λ and the column normalisation are the ridge's; FedNCM's solve uses neither
        super().__init__(num_classes, p, lam=1.0, fit_intercept=True, normalize_columns=False, device=device)

    def solve(self) -> NearestClassMeans:
        if self._solved is None:
            B = self.B.cpu().numpy()
            self._solved = NearestClassMeans(B[:-1], B[-1])
        return self._solved
