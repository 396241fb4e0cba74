"""``fed3r.secure``: Fed3R-Sync on the device — statistics summed with the group's under SecAgg.

The device computes its dense statistics (the same ``Fed3RStatsTask`` as plain Fed3R) and
packs them into the fixed-shape vector of ``protocols.payloads.secagg``; ``SecureUpdate`` does
the rest. Under distributed DP (the task's ``dp``) the device adds its share of noise first.
"""

from __future__ import annotations

import numpy as np

from protocols.identity import DeviceIdentity
from protocols.payloads.secagg import pack_sync_vector

from ..agent import TaskDeclined
from .fed3r_stats import Fed3RStatsTask
from .secure_update import SecAggSessions, SecureUpdate


class SecureFed3R(SecureUpdate):
    def __init__(self, identity: DeviceIdentity, aggregator_public_key: bytes, stats: Fed3RStatsTask,
                 sessions: SecAggSessions | None = None, noise_rng: np.random.Generator | None = None):
        super().__init__(identity, aggregator_public_key, sessions, noise_rng)
        self.stats = stats

    def vector(self, params: dict, tensors: dict[str, np.ndarray]) -> np.ndarray:
        body, stats = self.stats(dict(params, format="dense", dtype="float64"))
        n = body["n"]
        if n > int(params["max_samples"]):
            raise TaskDeclined(f"{n} local samples exceed the round's bound of {params['max_samples']}")
        if "dp" not in params:
            return pack_sync_vector(stats["A_upper"], stats["b"], n)
        # Distributed DP (features clipped, samples capped by the stats task): the sample count would
        # be an un-noised release, so it is left out of the sum (0), and the statistics carry noise.
        return self.add_noise(pack_sync_vector(stats["A_upper"], stats["b"], 0), params["dp"])


__all__ = ["SecureFed3R"]
