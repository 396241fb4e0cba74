"""``ladd.train.secure``: a LADD self-training round whose updates reach the aggregator only as a sum.

The device trains exactly as for ``ladd.train`` (same handler, same recipe, same checks) and
contributes one vector laid out by the task's ``slots`` (``protocols.payloads.secagg.
ClusterSlotLayout``): n·φ for the global tensors, n·θ in its own cluster's slot (zeros when the
round disabled that slot), n, and its cluster's weight and count. The group sum gives the
server LADD's cluster-specific averages without any device's tensors being seen.

Refused here (the device declines, the round goes on without it), before secure aggregation
would overflow its fixed-point range or sum a vector the server would misread:

* the task's ``group`` is not the group id of its ``slots`` (the group id is inside the
  aggregator's signed round configuration, so this binds the layout the device packs to the
  round it joins);
* the slots' tensors are not exactly the trained ones, or the device's cluster has no slot;
* more than ``max_samples`` local images, or a trained entry with |w| > ``max_abs_param``.

Under distributed DP (the task's ``dp``) the device sends its clipped update with weight 1 and
its share of the noise instead (``dp_vector``): the bound then comes from the clip norm.
"""

from __future__ import annotations

import numpy as np

from protocols.identity import DeviceIdentity
from protocols.payloads.ladd import parse_train_task, unpack
from protocols.payloads.secagg import SECURE_LADD_KIND, ClusterSlotLayout
from protocols.payloads.secure_tasks import SecureLaddParams

from ..agent import TaskDeclined
from .ladd_training import LaddTrainTask, TrainedUpdate
from .params import read_params
from .secure_update import SecAggSessions, SecureUpdate


class SecureLaddTraining(SecureUpdate):
    round_type = SecureLaddParams
    kind = SECURE_LADD_KIND

    def __init__(self, identity: DeviceIdentity, aggregator_public_key: bytes, training: LaddTrainTask,
                 sessions: SecAggSessions | None = None, noise_rng: np.random.Generator | None = None):
        super().__init__(identity, aggregator_public_key, sessions, noise_rng)
        self.training = training
        self.last: TrainedUpdate | None = None      # the last plaintext update (never sent)

    def vector(self, params: dict, tensors: dict[str, np.ndarray]) -> np.ndarray:
        task = read_params(SecureLaddParams, params, SECURE_LADD_KIND)
        slots, max_samples, limit = task.slot_layout(), task.max_samples, float(task.max_abs_param)
        trained = self.training.train(params, tensors)      # the plain handler reads the plain kind's params
        if task.dp is not None:
            return self.dp_vector(task, slots, trained, tensors)
        if trained.n > max_samples:
            raise TaskDeclined(f"{trained.n} local images exceed the round's bound of {max_samples}")
        largest = max((float(np.abs(a).max()) for a in trained.arrays.values() if a.size), default=0.0)
        if largest > limit:
            raise TaskDeclined(f"trained model has |w| = {largest:.3g} > the round's bound {limit:g}")
        try:
            vector = slots.pack(trained.arrays, trained.n, trained.cluster)
        except ValueError as exc:
            raise TaskDeclined(f"cannot fill the round's slots: {exc}") from exc
        self.last = trained
        return vector

    def dp_vector(self, task: SecureLaddParams, slots: ClusterSlotLayout, trained: TrainedUpdate,
                  tensors: dict[str, np.ndarray]) -> np.ndarray:
        """Distributed DP-LADD: the slots filled with clip(w_k − w_c) (its φ and θ part clipped
        together), weight 1, plus this device's share of noise on every tensor entry of every slot
        (aggregator/strategies/dp_ladd.py); n and the cluster weights and counts stay exact."""
        try:
            layout, flats = parse_train_task(task, tensors)
        except ValueError as exc:
            raise TaskDeclined(f"bad ladd.train.secure task: {exc}") from exc
        clipped = self.clipped_delta(task.dp.clip_norm, trained.arrays, unpack(flats["model"], layout))
        try:
            vector = slots.pack(clipped, 1, trained.cluster)
        except ValueError as exc:
            raise TaskDeclined(f"cannot fill the round's slots: {exc}") from exc
        self.last = trained
        return self.add_noise(vector, task.dp, noised=slice(0, slots.tensors_size))


__all__ = ["SecureLaddTraining"]
