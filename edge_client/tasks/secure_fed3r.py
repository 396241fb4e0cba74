"""``fed3r.secure``: Fed3R-Sync on the device — statistics summed with the group's under SecAgg.

The device computes its dense statistics (the same ``Fed3RStatsTask`` as plain Fed3R) and
packs them into the fixed-shape vector of ``protocols.payloads.secagg``; ``SecureUpdate`` does
the rest. Under distributed DP (the task's ``dp``) the device adds its share of noise first,
after scaling the vector's blocks when the task says how (``block_scales``). The private feature
center's round (``center_round``) takes only (Σ z, n) of its clipped rows, noised whole; the
rounds after it carry the center (``centered``, the ``feature_center`` tensor), which the
statistics subtract from every row before the clip, as in plain DP Fed3R.

Its input key is the vector before noise (``edge_client/secure_inputs.py``): the statistics are a
function of the device's window, so the same window sent to two groups is the same input.
"""

from __future__ import annotations

import numpy as np

import dataclasses

from protocols.identity import DeviceIdentity
from protocols.payloads.secagg import SYNC_KIND, pack_sync_vector, scale_sync_blocks, sync_center_vector
from protocols.payloads.secure_tasks import SecureFed3RParams

from ..agent import TaskDeclined
from ..secure_inputs import vector_key
from .fed3r_stats import Fed3RStatsTask
from .params import read_params
from .secure_update import SecAggSessions, SecureUpdate


class SecureFed3R(SecureUpdate):
    round_type = SecureFed3RParams
    kind = SYNC_KIND

    def __init__(self, identity: DeviceIdentity, aggregator_public_key: bytes, stats: Fed3RStatsTask,
                 sessions: SecAggSessions | None = None, noise_rng: np.random.Generator | None = None):
        super().__init__(identity, aggregator_public_key, sessions, noise_rng)
        self.stats = stats

    def vector(self, params: dict, tensors: dict[str, np.ndarray]) -> np.ndarray:
        return self.contribution(params, tensors)[0]

    def contribution(self, params: dict, tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, str]:
        """The vector and its input key: the digest of the vector before any noise, this device's
        exact input (the task's ignored fields, format or a larger max_samples, cannot rename it)."""
        task = read_params(SecureFed3RParams, params, SYNC_KIND)
        body, stats = self.stats(dataclasses.replace(task, format="dense", dtype="float64"), tensors)
        n = body["n"]
        if n > task.max_samples:
            raise TaskDeclined(f"{n} local samples exceed the round's bound of {task.max_samples}")
        if task.center_round:        # (Σ z, n), every entry noised: the count is the center's denominator
            clean = sync_center_vector(stats["A_upper"], np.shape(stats["b"])[1])
            noised = slice(0, len(clean))
        elif task.dp is None:
            clean, noised = pack_sync_vector(stats["A_upper"], stats["b"], n), None
        else:
            # Distributed DP (features clipped, samples capped by the stats task): the sample count would
            # be an un-noised release, so it is left out of the sum (0), and the statistics carry noise.
            clean, noised = pack_sync_vector(stats["A_upper"], stats["b"], 0), None
            if task.block_scales is not None:       # per-block noise: the blocks scaled, 1 in the count slot
                num_classes, p = np.shape(stats["b"])
                clean = scale_sync_blocks(clean, p, num_classes, task.block_scales.a_off_diagonal,
                                          task.block_scales.b)
                clean[-1] = 1.0
        named = vector_key(SYNC_KIND, clean)
        return (clean if task.dp is None else self.add_noise(clean, task.dp, noised=noised)), named


__all__ = ["SecureFed3R"]
