"""Accuracy of the shared model and the personalised-accuracy aggregate, from features.

* Global accuracy: a linear head (weight (C, d), bias (C,)) on a held-out set of features,
  ``argmax(f Wᵀ + b)``. A softmax and its temperature do not change the argmax.
* WMA (weighted mean accuracy, the Fed3R paper's PFL metric as its code computes it): every
  device reports (correct_k, n_k) on its local held-out split; WMA = Σ_k n_k·acc_k / Σ_k n_k
  = Σ correct_k / Σ n_k. Devices with n_k = 0 do not count.
"""

from __future__ import annotations

import numpy as np


def head_logits(weight: np.ndarray, bias: np.ndarray, features: np.ndarray) -> np.ndarray:
    weight, bias = np.asarray(weight), np.asarray(bias)
    features = np.asarray(features)
    if weight.ndim != 2 or bias.shape != (weight.shape[0],):
        raise ValueError(f"head must be weight (C, d) and bias (C,), got {weight.shape} and {bias.shape}")
    if features.ndim != 2 or features.shape[1] != weight.shape[1]:
        raise ValueError(f"features must be (n, {weight.shape[1]}), got {features.shape}")
    return features @ weight.T + bias


def head_accuracy(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray) -> float:
    labels = np.asarray(labels)
    if labels.shape != (len(features),) or len(labels) == 0:
        raise ValueError(f"need one label per feature row and at least one row, got {labels.shape}")
    return float((head_logits(weight, bias, features).argmax(axis=1) == labels).mean())


def weighted_mean_accuracy(correct, totals) -> float:
    """Σ correct_k / Σ n_k over devices (= the n_k-weighted mean of per-device accuracies)."""
    correct, totals = np.asarray(correct, dtype=np.int64), np.asarray(totals, dtype=np.int64)
    if correct.shape != totals.shape or correct.ndim != 1:
        raise ValueError("correct and totals must be 1-D arrays of the same length")
    if (totals < 0).any() or (correct < 0).any() or (correct > totals).any():
        raise ValueError("need 0 <= correct_k <= n_k for every device")
    if totals.sum() == 0:
        raise ValueError("no evaluation samples on any device")
    return float(correct.sum() / totals.sum())
