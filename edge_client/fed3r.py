"""Fed3R client statistics: A_k = ZᵀZ and per-class sums b_k^c, accumulated in float64.

Features may arrive in batches (a device streams its images through the backbone), so the
accumulator is incremental; the result is identical to computing ZᵀZ on the stacked matrix up
to float64 summation order. The optional random-feature map (Fed3R-RF), the clipping of
each row to ``feature_clip_norm`` (differential privacy; after subtracting ``feature_center``
when the task carries one) and the appended constant-1 bias feature
are applied here, before the statistics; the aggregator's evaluation applies the same map and
bias to test features (not the clipping: a deployed head sees raw features).

A device with fewer samples than features may send the exact factor form instead
(:func:`canonical_factor`, ``protocols/payloads/fed3r.py``, ``docs/algorithms.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.random_features import RandomFourierFeatures


class Fed3RAccumulator:
    def __init__(self, num_classes: int, feature_dim: int, fit_intercept: bool = True,
                 random_features: RandomFourierFeatures | None = None, keep_rows: bool = False,
                 feature_clip_norm: float = 0.0, feature_center: np.ndarray | None = None):
        self.num_classes = num_classes
        self.feature_clip_norm = float(feature_clip_norm)
        self.feature_center = None if feature_center is None else np.asarray(feature_center, dtype=np.float64)
        if self.feature_center is not None and self.feature_center.shape != (feature_dim,):
            raise ValueError(f"feature_center must be ({feature_dim},), got {self.feature_center.shape}")
        # the rows are kept (for the exact factor form) only while they are fewer than the features
        self._rows: list[np.ndarray] | None = [] if keep_rows else None
        self._row_labels: list[np.ndarray] = []
        self.fit_intercept = fit_intercept
        self.rf = random_features
        if self.rf is not None and not hasattr(self.rf, "omega_"):
            self.rf.fit(n_features=feature_dim)
        base = self.rf.n_components if self.rf is not None else feature_dim
        self.input_dim = feature_dim
        self.p = base + (1 if fit_intercept else 0)
        # A (p x p float64: 13 MB at p = 1,281) is built only when it is read: a device of a few
        # images that sends the factor form never allocates it
        self._A: np.ndarray | None = None
        self.B = np.zeros((num_classes, self.p), dtype=np.float64)
        self.counts = np.zeros(num_classes, dtype=np.int64)
        self.weight = 1.0                 # every row's weight (:meth:`weigh`)
        self._weighed_n: int | None = None

    def transform(self, features: np.ndarray) -> np.ndarray:
        Z = np.asarray(features, dtype=np.float64)
        if Z.ndim != 2 or Z.shape[1] != self.input_dim:
            raise ValueError(f"features must be (n, {self.input_dim}), got {Z.shape}")
        if not np.isfinite(Z).all():
            raise ValueError("features contain NaN or Inf (broken backbone or input?)")
        if self.feature_center is not None:
            Z = Z - self.feature_center      # DP's released mean: the clip then bounds what varies, not the mean
        if self.rf is not None:
            Z = self.rf.transform(Z)
        if self.feature_clip_norm > 0:
            # DP: every row's norm is bounded (before the bias feature), which bounds A_k and b_k
            norms = np.linalg.norm(Z, axis=1, keepdims=True)
            Z = Z * np.minimum(1.0, self.feature_clip_norm / np.maximum(norms, 1e-300))
        if self.fit_intercept:
            Z = np.hstack([Z, np.ones((Z.shape[0], 1))])
        return Z

    def update(self, features: np.ndarray, labels: np.ndarray) -> None:
        if self._weighed_n is not None:
            raise ValueError("the statistics are weighed: no more rows")
        labels = np.asarray(labels)
        if labels.ndim != 1 or len(labels) != len(features):
            raise ValueError("labels must be a vector with one label per feature row")
        if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes})")
        Z = self.transform(features)
        if not np.isfinite(Z).all():    # e.g. random features of a sigma so small that z·ω/σ overflows
            raise ValueError("the transformed features are not all finite (NaN or Inf): no statistics of them")
        if self._rows is not None:
            self._rows.append(Z)
            self._row_labels.append(labels)
            if self._A is not None:         # A was read already: keep it current
                self._A += Z.T @ Z
            if sum(len(z) for z in self._rows) >= self.p:
                self._gram()
                self._rows, self._row_labels = None, []
        else:
            self._gram(Z)
        onehot = np.zeros((len(labels), self.num_classes))
        onehot[np.arange(len(labels)), labels] = 1.0
        self.B += onehot.T @ Z
        self.counts += np.bincount(labels, minlength=self.num_classes)

    def _gram(self, Z: np.ndarray | None = None) -> np.ndarray:
        """A, built on first use from the kept rows, chunk by chunk in the order they came (the
        same float sums as adding each chunk's ZᵀZ when it arrived, times the rows' weight), plus
        ``Z``'s ZᵀZ."""
        if self._A is None:
            self._A = np.zeros((self.p, self.p), dtype=np.float64)
            for chunk in self._rows or ():
                self._A += chunk.T @ chunk
            if self._weighed_n is not None:
                self._A *= self.weight
        if Z is not None:
            self._A += Z.T @ Z
        return self._A

    @property
    def A(self) -> np.ndarray:
        return self._gram()

    @property
    def n(self) -> int:
        return int(self.counts.sum()) if self._weighed_n is None else self._weighed_n

    def weigh(self, total: int) -> None:
        """Weigh the statistics' samples to ``total`` in all, once every row is in (a DP task's
        ``cap_by_weight``): each of the n rows by total/n when n > total, so A = Σ w z zᵀ and
        b = Σ w y zᵀ are bounded as ``total`` rows are (``docs/algorithms.md``, DP Fed3R) and
        :attr:`n` is ``total``; nothing changes when n ≤ total."""
        rows = int(self.counts.sum())
        if self._weighed_n is not None:
            raise ValueError("the statistics are weighed already")
        if rows <= total:
            return
        self.weight, self._weighed_n = total / rows, int(total)
        if self._A is not None:
            self._A *= self.weight
        self.B *= self.weight

    def sparse(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(A, class_ids, b_rows): only the classes present locally."""
        ids = np.flatnonzero(self.counts)
        return self.A, ids.astype(np.int64), self.B[ids]

    def factor(self) -> FactorForm | None:
        """The canonical exact factor form of the statistics, or None when the rows were not kept
        (not asked for, or n ≥ p)."""
        if not self._rows:
            return None
        Z = np.vstack(self._rows)
        labels = np.concatenate(self._row_labels)
        ids = np.flatnonzero(self.counts).astype(np.int64)
        live = (Z != 0).any(axis=0)                          # ReLU features: dead channels are exact zeros
        R, qty = canonical_factor(Z[:, live], (labels[:, None] == ids[None, :]).astype(np.float64))
        if self._weighed_n is not None:     # A = w RᵀR and b = w Rᵀ(QᵀY): both factors times √w
            root = np.sqrt(self.weight)
            R, qty = R * root, qty * root
        return FactorForm(R, qty, ids, np.flatnonzero(~live).astype(np.int64))


@dataclass(frozen=True)
class FactorForm:
    r_factor: np.ndarray       # (r, q): the canonical factor of A over the non-zero columns
    qty: np.ndarray            # (r, m)
    class_ids: np.ndarray      # (m,)
    zero_columns: np.ndarray   # (p - q,): the columns of Z that are zero in every row


# A column whose part orthogonal to the pivot columns before it is at most this fraction of its
# norm lies in their span. Householder QR leaves a dependent column a residual of a few n·ε of its
# own norm (≤ 3.3e-13 measured on MobileNetV2 features, n ≤ 64); the smallest independent one
# measured was 8e-5 of its norm: the threshold sits orders of magnitude from both.
DEPENDENT_RESIDUAL = 1e-10


def canonical_factor(Z: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(R, QᵀY) with Z = QR (Q with orthonormal columns) and R the canonical factor of ZᵀZ: row
    echelon form, positive pivots, rank(Z) rows. Householder QR that skips the columns lying in the
    span of the pivot columns before them (their residual below ``DEPENDENT_RESIDUAL`` of their
    norm, a function of ZᵀZ alone): the pivots are where the rank of ZᵀZ's leading blocks grows,
    as ``docs/algorithms.md`` argues. Z (n × q) has no zero column; Y is (n × m)."""
    W, V = np.array(Z, dtype=np.float64), np.array(Y, dtype=np.float64)
    n, q = W.shape
    floor = DEPENDENT_RESIDUAL * np.linalg.norm(W, axis=0)
    pivots: list[int] = []
    col = 0
    while len(pivots) < n and col < q:
        row = len(pivots)
        independent = np.flatnonzero(np.linalg.norm(W[row:, col:], axis=0) > floor[col:])
        if len(independent) == 0:
            break
        j = col + int(independent[0])
        W[row:, col:j] = 0.0                                 # dependent columns: only rounding left below this row
        v = W[row:, j].copy()                                # x; the reflector that maps x to -sign(x0)·‖x‖·e1:
        v[0] += np.copysign(np.linalg.norm(v), v[0])          # v = x + sign(x0)·‖x‖·e1
        vv = float(v @ v)
        W[row:, j:] -= np.outer(v, (2.0 / vv) * (v @ W[row:, j:]))
        V[row:] -= np.outer(v, (2.0 / vv) * (v @ V[row:]))
        W[row + 1:, j] = 0.0
        if W[row, j] < 0:                                    # sign convention: positive pivots
            W[row, j:] *= -1.0
            V[row] *= -1.0
        pivots.append(j)
        col = j + 1
    r = len(pivots)
    R = W[:r]
    for i, j in enumerate(pivots):       # exact zeros before each pivot (so by construction already; the wire needs it)
        R[i, :j] = 0.0
    return R, V[:r]
