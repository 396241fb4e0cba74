"""``fedavg.secure``: a FedAvg(ψ) round whose head updates reach the aggregator only as a sum.

The device trains the head exactly as for ``fedavg.head`` (same handler, same recipe) and
contributes the vector ``[n·weight | n·bias | n]`` (``protocols.payloads.secagg``): the
group sum gives Σ n_k θ_k and Σ n_k, hence the FedAvg mean, without any θ_k being seen. A
trained head with an entry beyond the round's ``max_abs_param`` is refused here (declined),
before secure aggregation would overflow its fixed-point range.
"""

from __future__ import annotations

import numpy as np

from protocols.identity import DeviceIdentity
from protocols.payloads.secagg import pack_weighted_head

from ..agent import TaskDeclined
from .head_training import HeadTrainingTask
from .secure_update import SecAggSessions, SecureUpdate


class SecureHeadTraining(SecureUpdate):
    def __init__(self, identity: DeviceIdentity, aggregator_public_key: bytes, training: HeadTrainingTask,
                 sessions: SecAggSessions | None = None):
        super().__init__(identity, aggregator_public_key, sessions)
        self.training = training

    def vector(self, params: dict, tensors: dict[str, np.ndarray]) -> np.ndarray:
        body, head = self.training(params, tensors)
        n, limit = body["n"], float(params["max_abs_param"])
        if n > int(params["max_samples"]):
            raise TaskDeclined(f"{n} local samples exceed the round's bound of {params['max_samples']}")
        largest = max(float(np.abs(head["weight"]).max()), float(np.abs(head["bias"]).max()))
        if largest > limit:
            raise TaskDeclined(f"trained head has |θ| = {largest:.3g} > the round's bound {limit:g}")
        return pack_weighted_head(head["weight"], head["bias"], n)


__all__ = ["SecureHeadTraining"]
