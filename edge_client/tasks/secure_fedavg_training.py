"""``fedavg.secure`` / ``fedavg.tail.secure``: FedAvg rounds whose updates reach the
aggregator only as a sum.

The device trains exactly as for the plain kind (the wrapped handler: ``fedavg.head``'s
``HeadTrainingTask`` or ``fedavg.tail``'s ``TailTrainingTask``, same recipe) and contributes
``[n·t_1 | … | n·t_m | n]`` over the tensors it trained, in the task's ``vector_order``
(``protocols.payloads.secagg``; default weight, bias): the group sum gives Σ n_k θ_k and
Σ n_k, hence the FedAvg mean, without any θ_k being seen. A trained tensor with an entry beyond
the round's ``max_abs_param`` is refused here (declined), before secure aggregation would
overflow its fixed-point range. With the task's ``update_clip_norm`` C the device first clips its
update θ − θ_t to norm C (the aggregator checks each group's sum against Σ n_k·C). Under distributed DP (the task's ``dp``) the device sends its
clipped update instead, with its share of the noise (``dp_vector``).
"""

from __future__ import annotations

import numpy as np

from protocols.identity import DeviceIdentity
from protocols.payloads.secagg import SECURE_FEDAVG_KIND, pack_weighted
from protocols.payloads.secure_tasks import SecureUpdateRound
from protocols.payloads.task_params import DpRound

from ..agent import TaskDeclined
from .params import read_params
from .secure_update import SecAggSessions, SecureUpdate


class SecureFedAvgTraining(SecureUpdate):
    """``training``: a FedAvg-family handler, ``(params, tensors) -> (body with n, trained tensors)``."""

    def __init__(self, identity: DeviceIdentity, aggregator_public_key: bytes, training,
                 sessions: SecAggSessions | None = None, noise_rng: np.random.Generator | None = None):
        super().__init__(identity, aggregator_public_key, sessions, noise_rng)
        self.training = training

    def vector(self, params: dict, tensors: dict[str, np.ndarray]) -> np.ndarray:
        secure = read_params(SecureUpdateRound, params, SECURE_FEDAVG_KIND)
        order = list(secure.vector_order)
        body, trained = self.training(params, tensors)      # the plain handler reads the plain kind's params
        if sorted(order) != sorted(trained):
            raise TaskDeclined(f"vector_order {order!r} does not name exactly the trained tensors {sorted(trained)}")
        if secure.dp is not None:
            return self.dp_vector(secure.dp, order, trained, tensors)
        n, limit = body["n"], float(secure.max_abs_param)
        if n > secure.max_samples:
            raise TaskDeclined(f"{n} local samples exceed the round's bound of {secure.max_samples}")
        if secure.update_clip_norm:     # bounded influence: the server checks the group's sum against n·C
            clipped = self.clipped_delta(secure.update_clip_norm, trained, tensors)
            trained = {k: np.asarray(tensors[k], np.float64) + clipped[k] for k in trained}
        largest = max(float(np.abs(t).max()) for t in trained.values())
        if largest > limit:
            raise TaskDeclined(f"trained model has |θ| = {largest:.3g} > the round's bound {limit:g}")
        return pack_weighted(trained, order, n)

    def dp_vector(self, dp: DpRound, order: list, trained: dict[str, np.ndarray],
                  start: dict[str, np.ndarray]) -> np.ndarray:
        """Distributed DP-FedAvg: [clip(θ_k − θ_t) | 1] plus this device's share of noise; devices are
        unweighted (n_k would make the sensitivity data-dependent), the server divides by κ."""
        return self.add_noise(pack_weighted(self.clipped_delta(dp.clip_norm, trained, start), order, 1), dp)


__all__ = ["SecureFedAvgTraining"]

