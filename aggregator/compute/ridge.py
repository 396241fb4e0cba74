"""Closed-form ridge classifier (Fed3R's solver), with scikit-learn estimator conventions.

W* = (A + λI)⁻¹ B with A = ZᵀZ and B = ZᵀY over one-hot targets (Fed3R [P] Eq. 6). With
``fit_intercept`` a constant-1 column is appended to Z before A and B are formed, so λ also
regularises the bias (as the reference code does). λ is added exactly once, here, never by
devices. The solve is a Cholesky factorisation in float64 (A + λI is symmetric positive
definite for λ > 0), on CUDA when available, else LAPACK's through scipy. Afterwards every class column is divided by the L2
norm of its d weight entries (bias divided by the same norm; a zero norm counts as 1e-6): the
paper's class-imbalance correction. Set ``normalize_columns=False`` for the plain ridge solution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from aggregator.compute.device import cholesky_in_place, cholesky_solve, pick_device

# torch is imported where it is used, not here: the job registry imports this module, and a
# command that only checks a config (or prints its help) must not pay torch's import (~1.3 s).
if TYPE_CHECKING:
    import torch

NOT_POSITIVE_DEFINITE = "A + λI is not positive definite: statistics are corrupt (non-Gram A?)"


def append_bias(Z: np.ndarray) -> np.ndarray:
    Z = np.asarray(Z, dtype=np.float64)
    return np.hstack([Z, np.ones((Z.shape[0], 1))])


def gram_statistics(Z: np.ndarray, y: np.ndarray, num_classes: int, fit_intercept: bool = True):
    """(A, B) = (ZᵀZ, ZᵀY) in float64 for one-hot Y; the centralized reference."""
    Zb = append_bias(Z) if fit_intercept else np.asarray(Z, dtype=np.float64)
    Y = np.zeros((len(y), num_classes))
    Y[np.arange(len(y)), y] = 1.0
    return Zb.T @ Zb, Zb.T @ Y


class LinearClassifier:
    """A fitted linear head's predictions (sklearn's names): coef_ (C, d), intercept_ (C,), n_features_in_."""

    def decision_function(self, Z: np.ndarray) -> np.ndarray:
        Z = np.asarray(Z, dtype=np.float64)
        if Z.ndim != 2 or Z.shape[1] != self.n_features_in_:
            raise ValueError(f"expected (n, {self.n_features_in_}) features, got {Z.shape}")
        return Z @ self.coef_.T + self.intercept_

    def predict(self, Z: np.ndarray) -> np.ndarray:
        return self.decision_function(Z).argmax(axis=1)

    def score(self, Z: np.ndarray, y: np.ndarray) -> float:
        return float((self.predict(Z) == np.asarray(y)).mean())


class ClosedFormRidge(LinearClassifier):
    def __init__(self, lam: float = 0.01, fit_intercept: bool = True, normalize_columns: bool = True,
                 device: str = "auto"):
        self.lam = lam
        self.fit_intercept = fit_intercept
        self.normalize_columns = normalize_columns
        self.device = device

    def fit(self, Z: np.ndarray, y: np.ndarray, num_classes: int | None = None) -> "ClosedFormRidge":
        y = np.asarray(y)
        C = int(num_classes if num_classes is not None else y.max() + 1)
        A, B = gram_statistics(Z, y, C, self.fit_intercept)
        return self.fit_statistics(A, B)

    def fit_statistics(self, A, B, upper: bool = False) -> "ClosedFormRidge":
        """Solve from sufficient statistics A (p×p, without λ) and B (p×C); numpy or torch.
        ``upper``: only A's upper triangle is filled (and read), what a packed sum unpacks to fastest."""
        if self.lam <= 0:
            raise ValueError("lam must be > 0 (A alone may be singular)")
        import torch

        dev = pick_device(self.device)
        A_t = torch.as_tensor(A, dtype=torch.float64, device=dev)
        B_t = torch.as_tensor(B, dtype=torch.float64, device=dev)
        p = A_t.shape[0]
        if A_t.shape != (p, p) or B_t.ndim != 2 or B_t.shape[0] != p:
            raise ValueError(f"shapes do not match: A {tuple(A_t.shape)}, B {tuple(B_t.shape)}")
        W = self._solve(A_t, B_t, upper)                         # (p, C)
        self.raw_weights_ = W.cpu().numpy()
        d = p - 1 if self.fit_intercept else p
        weights, bias = W[:d], (W[d] if self.fit_intercept else torch.zeros(W.shape[1], dtype=W.dtype, device=dev))
        if self.normalize_columns:
            norms = torch.linalg.vector_norm(weights, dim=0)
            norms = torch.where(norms == 0, torch.full_like(norms, 1e-6), norms)
            weights, bias = weights / norms, bias / norms
        self.coef_ = weights.T.contiguous().cpu().numpy()      # (C, d) like scikit-learn
        self.intercept_ = bias.cpu().numpy()                   # (C,)
        self.n_features_in_ = d
        self.classes_ = np.arange(W.shape[1])
        return self

    def _solve(self, A_t: torch.Tensor, B_t: torch.Tensor, upper: bool) -> torch.Tensor:
        """(A + λI)⁻¹B by Cholesky: LAPACK in place on a copy on the CPU (``compute.cholesky_in_place``),
        torch on the GPU."""
        import torch

        if A_t.device.type != "cpu":
            return torch_ridge_solve(A_t, B_t, self.lam, upper)
        reg = A_t.numpy().copy() if upper else A_t.numpy().T.copy()      # C order, the upper triangle read
        factor, ok = cholesky_in_place(reg, self.lam)
        if not ok:
            raise np.linalg.LinAlgError(NOT_POSITIVE_DEFINITE)
        return torch.from_numpy(cholesky_solve(factor, B_t.numpy()))



def torch_ridge_solve(A_t: torch.Tensor, B_t: torch.Tensor, lam: float, upper: bool) -> torch.Tensor:
    """(A + λI)⁻¹B with torch's Cholesky on A's device (what a GPU runs); ``upper``: only A's upper
    triangle is read, else its lower one."""
    import torch

    reg = A_t.clone()
    reg.diagonal().add_(lam)
    L, info = torch.linalg.cholesky_ex(reg, upper=upper)
    if int(info) != 0:
        raise np.linalg.LinAlgError(NOT_POSITIVE_DEFINITE)
    return torch.cholesky_solve(B_t, L, upper=upper)
