"""``fed3r.secure``: Fed3R-Sync on the device — statistics summed with the group's under SecAgg.

The device computes its dense statistics (the same ``Fed3RStatsTask`` as plain Fed3R) and
packs them into the fixed-shape vector of ``protocols.payloads.secagg``; ``SecureUpdate`` does
the rest. Under distributed DP (the task's ``dp``) the device adds its share of noise first,
after scaling the vector's blocks when the task says how (``block_scales``). The private feature
center's round (``center_round``) takes only (Σ z, n) of its clipped rows, noised whole; the
rounds after it carry the center (``centered``, the ``feature_center`` tensor), which the
statistics subtract from every row before the clip, as in plain DP Fed3R.
"""

from __future__ import annotations

import numpy as np

import dataclasses

from protocols.identity import DeviceIdentity
from protocols.payloads.secagg import SYNC_KIND, pack_sync_vector, scale_sync_blocks, sync_center_vector
from protocols.payloads.secure_tasks import SecureFed3RParams

from ..agent import TaskDeclined
from .fed3r_stats import Fed3RStatsTask
from .params import read_params
from .secure_update import SecAggSessions, SecureUpdate


class SecureFed3R(SecureUpdate):
    round_type = SecureFed3RParams

    def __init__(self, identity: DeviceIdentity, aggregator_public_key: bytes, stats: Fed3RStatsTask,
                 sessions: SecAggSessions | None = None, noise_rng: np.random.Generator | None = None):
        super().__init__(identity, aggregator_public_key, sessions, noise_rng)
        self.stats = stats

    def vector(self, params: dict, tensors: dict[str, np.ndarray]) -> np.ndarray:
        task = read_params(SecureFed3RParams, params, SYNC_KIND)
        body, stats = self.stats(dataclasses.replace(task, format="dense", dtype="float64"), tensors)
        n = body["n"]
        if n > task.max_samples:
            raise TaskDeclined(f"{n} local samples exceed the round's bound of {task.max_samples}")
        if task.center_round:        # (Σ z, n), every entry noised: the count is the center's denominator
            center = sync_center_vector(stats["A_upper"], np.shape(stats["b"])[1])
            return self.add_noise(center, task.dp, noised=slice(0, len(center)))
        if task.dp is None:
            return pack_sync_vector(stats["A_upper"], stats["b"], n)
        # Distributed DP (features clipped, samples capped by the stats task): the sample count would
        # be an un-noised release, so it is left out of the sum (0), and the statistics carry noise.
        vector = pack_sync_vector(stats["A_upper"], stats["b"], 0)
        if task.block_scales is not None:       # per-block noise: the blocks scaled, 1 in the count slot
            num_classes, p = np.shape(stats["b"])
            vector = scale_sync_blocks(vector, p, num_classes, task.block_scales.a_off_diagonal, task.block_scales.b)
            vector[-1] = 1.0
        return self.add_noise(vector, task.dp)


__all__ = ["SecureFed3R"]
