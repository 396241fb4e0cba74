"""``fedavg.secure`` / ``fedavg.tail.secure``: FedAvg rounds whose updates reach the
aggregator only as a sum.

The device trains exactly as for the plain kind (the wrapped handler: ``fedavg.head``'s
``HeadTrainingTask`` or ``fedavg.tail``'s ``TailTrainingTask``, same recipe) and contributes
``[n·t_1 | … | n·t_m | n]`` over the tensors it trained, in the task's ``vector_order``
(``protocols.payloads.secagg``; default weight, bias): the group sum gives Σ n_k θ_k and
Σ n_k, hence the FedAvg mean, without any θ_k being seen. A trained tensor with an entry beyond
the round's ``max_abs_param`` is refused here (declined), before secure aggregation would
overflow its fixed-point range.
"""

from __future__ import annotations

import numpy as np

from protocols.identity import DeviceIdentity
from protocols.payloads.secagg import HEAD_ORDER, pack_weighted

from ..agent import TaskDeclined
from .secure_update import SecAggSessions, SecureUpdate


class SecureFedAvgTraining(SecureUpdate):
    """``training``: a FedAvg-family handler, ``(params, tensors) -> (body with n, trained tensors)``."""

    def __init__(self, identity: DeviceIdentity, aggregator_public_key: bytes, training,
                 sessions: SecAggSessions | None = None):
        super().__init__(identity, aggregator_public_key, sessions)
        self.training = training

    def vector(self, params: dict, tensors: dict[str, np.ndarray]) -> np.ndarray:
        order = params.get("vector_order", list(HEAD_ORDER))
        body, trained = self.training(params, tensors)
        if not isinstance(order, list) or sorted(order) != sorted(trained) or len(set(order)) != len(order):
            raise TaskDeclined(f"vector_order {order!r} does not name exactly the trained tensors {sorted(trained)}")
        n, limit = body["n"], float(params["max_abs_param"])
        if n > int(params["max_samples"]):
            raise TaskDeclined(f"{n} local samples exceed the round's bound of {params['max_samples']}")
        largest = max(float(np.abs(t).max()) for t in trained.values())
        if largest > limit:
            raise TaskDeclined(f"trained model has |θ| = {largest:.3g} > the round's bound {limit:g}")
        return pack_weighted(trained, order, n)


__all__ = ["SecureFedAvgTraining"]
