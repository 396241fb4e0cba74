"""Fed3R client statistics: A_k = ZᵀZ and per-class sums b_k^c, accumulated in float64.

Features may arrive in batches (a device streams its images through the backbone), so the
accumulator is incremental; the result is identical to computing ZᵀZ on the stacked matrix up
to float64 summation order. The optional random-feature map (Fed3R-RF), the clipping of
each row to ``feature_clip_norm`` (differential privacy) and the appended constant-1 bias feature
are applied here, before the statistics; the aggregator's evaluation applies the same map and
bias to test features (not the clipping: a deployed head sees raw features).
"""

from __future__ import annotations

import numpy as np

from protocols.random_features import RandomFourierFeatures


class Fed3RAccumulator:
    def __init__(self, num_classes: int, feature_dim: int, fit_intercept: bool = True,
                 random_features: RandomFourierFeatures | None = None, keep_rows: bool = False,
                 feature_clip_norm: float = 0.0):
        self.num_classes = num_classes
        self.feature_clip_norm = float(feature_clip_norm)
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
        self.A = np.zeros((self.p, self.p), dtype=np.float64)
        self.B = np.zeros((num_classes, self.p), dtype=np.float64)
        self.counts = np.zeros(num_classes, dtype=np.int64)

    def transform(self, features: np.ndarray) -> np.ndarray:
        Z = np.asarray(features, dtype=np.float64)
        if Z.ndim != 2 or Z.shape[1] != self.input_dim:
            raise ValueError(f"features must be (n, {self.input_dim}), got {Z.shape}")
        if not np.isfinite(Z).all():
            raise ValueError("features contain NaN or Inf (broken backbone or input?)")
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
        labels = np.asarray(labels)
        if labels.ndim != 1 or len(labels) != len(features):
            raise ValueError("labels must be a vector with one label per feature row")
        if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes})")
        Z = self.transform(features)
        if self._rows is not None:
            self._rows.append(Z)
            self._row_labels.append(labels)
            if sum(len(z) for z in self._rows) >= self.p:
                self._rows, self._row_labels = None, []
        self.A += Z.T @ Z
        onehot = np.zeros((len(labels), self.num_classes))
        onehot[np.arange(len(labels)), labels] = 1.0
        self.B += onehot.T @ Z
        self.counts += np.bincount(labels, minlength=self.num_classes)

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    def sparse(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(A, class_ids, b_rows): only the classes present locally."""
        ids = np.flatnonzero(self.counts)
        return self.A, ids.astype(np.int64), self.B[ids]

    def factor(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(R, QtY, class_ids) of the exact factor form, or None when it does not apply: rows not
        kept (n ≥ p), or R not unique (its leading block singular: rows linearly dependent), in
        which case the dense statistics are the only form that reveals nothing more."""
        if not self._rows:
            return None
        Z = np.vstack(self._rows)
        labels = np.concatenate(self._row_labels)
        Q, R = np.linalg.qr(Z)                               # Z (n×p), n < p: Q (n×n), R (n×p)
        signs = np.where(np.diagonal(R) < 0, -1.0, 1.0)
        R, Q = R * signs[:, None], Q * signs[None, :]
        diag = np.diagonal(R)
        if diag.min() <= 1e-10 * max(float(np.abs(R).max()), 1.0):
            return None
        ids = np.flatnonzero(self.counts).astype(np.int64)
        onehot = (labels[:, None] == ids[None, :]).astype(np.float64)
        return np.triu(R), Q.T @ onehot, ids
