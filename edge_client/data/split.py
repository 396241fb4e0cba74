"""A device's split of its local data into a training part and a held-out part (for OLL reports).

It lives in the device SDK because a real device (``fedfleet device``) splits its own data; the
emulated fleet (``fedfleet.emulation.partition``) re-exports it for its devices.
"""

from __future__ import annotations

import numpy as np


def train_holdout_split(
    indices: np.ndarray, holdout_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Random per-device (train, holdout) split of ``indices``, both sorted.

    The holdout gets ``round(holdout_fraction * n)`` samples, but at least one when the
    fraction is positive and at most ``n - 1``, so a device always keeps something to
    train on and a positive fraction always yields something to evaluate on (n >= 2).
    """
    indices = np.asarray(indices)
    if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(f"indices must be a 1-D integer array, got {indices.dtype} {indices.shape}")
    if len(np.unique(indices)) != len(indices):
        raise ValueError("indices contains duplicates")
    if not isinstance(holdout_fraction, (int, float, np.floating)) or not 0 <= holdout_fraction < 1:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction!r}")
    n = len(indices)
    # at most n - 1 for every n >= 1 (a single sample stays for training, whatever the fraction)
    n_holdout = min(int(round(holdout_fraction * n)), max(n - 1, 0))
    if holdout_fraction > 0 and n >= 2:
        n_holdout = max(n_holdout, 1)
    shuffled = np.random.default_rng(seed).permutation(indices).astype(np.int64)
    return np.sort(shuffled[n_holdout:]), np.sort(shuffled[:n_holdout])
