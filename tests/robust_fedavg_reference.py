"""What the robust FedAvg tests (tests/test_robust_fedavg_*.py, tests/test_fedavg_small_rounds.py)
share: fixed updates, their rows as the rules flatten them, the comparison of a result with a numpy
vector, and the contribution bound written out in numpy."""

import numpy as np

from aggregator.jobs.robustness_fields import PLAIN_MEAN

NORM_BOUND_ONLY = {**PLAIN_MEAN, "norm_bound_multiplier": 1.0}


def fixed_updates(m=7, seed=3):
    rng = np.random.default_rng(seed)
    return [({"weight": rng.normal(size=(2, 3)), "bias": rng.normal(size=2)}, int(rng.integers(1, 50)))
            for _ in range(m)]


def as_matrix(updates):
    """Rows: each update as [bias, weight.ravel()] (tensor names sorted, as the rules flatten)."""
    return np.stack([np.concatenate([t["bias"].ravel(), t["weight"].ravel()]) for t, _ in updates])


def split(vector):
    return {"bias": vector[:2], "weight": vector[2:].reshape(2, 3)}


def assert_params(got, want_vector):
    want = split(want_vector)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-15)


def contribution_bound_reference(x, n, multiplier):
    """w_k = n_k · min(1, c·median_j(n_j‖x_j‖) / (n_k‖x_k‖)), written out per update (x: the Δ rows)."""
    pulls = [n_k * np.linalg.norm(row) for row, n_k in zip(x, n)]
    limit = multiplier * np.median(pulls)
    return np.array([n_k * min(1.0, limit / pull) for n_k, pull in zip(n, pulls)])
