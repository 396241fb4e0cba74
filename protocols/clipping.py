"""L2 clipping of a model update taken as one vector: the bound differential privacy rests on.

Both sides clip the same way: the aggregator for central DP-FedAvg
(``aggregator/strategies/dp_fedavg.py``), a device for distributed DP under secure aggregation
(``edge_client/tasks/secure_fedavg_training.py``), where the server never sees the update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np


def global_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """L2 norm of all entries of a dict of tensors taken as one vector."""
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(t, dtype=np.float64)))) for t in tensors.values()))


def clip_update(delta: Mapping[str, np.ndarray], clip_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """(Δ · min(1, C/‖Δ‖), ‖Δ‖): the clipped update in float64 and its norm before clipping."""
    norm = global_norm(delta)
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return {k: np.asarray(v, dtype=np.float64) * factor for k, v in delta.items()}, norm
