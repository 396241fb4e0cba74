"""Secure Scaffold(ψ): Scaffold's rounds (``aggregator/jobs/scaffold.py``, option II) whose head
updates *and* control deltas reach the aggregator only as one sum.

Each round is one SecAgg (or SecAgg+) group, as secure FedAvg's (:class:`SecureFedAvgJob`). A
device trains as for ``scaffold.head`` (keeping its c_k in its state store), clips its Δc_k to
``control_clip_norm`` in L2 (what the plain server does to each Δc; the same function,
``protocols.clipping.clip_update``) and contributes ``[n·y | Δc_k | n]``
(``protocols.payloads.secagg.pack_controlled``; y and Δc in the task's ``vector_order``). The
unmasked sum gives Σ n_k y_k, Σ n_k and Σ Δc_k over the |S| survivors, so the server takes the
plain job's steps: w ← w + η_g · (Σ n_k y_k / Σ n_k − w) and c ← c + (|S| / K) · Σ Δc_k / |S|,
equal to plain Scaffold over the same devices up to the fixed-point resolution 2^-f.

Bound: every entry of a vector is at most max(max_samples × max(max_abs_param, 1),
control_clip_norm) in magnitude: the weighted head's entries as secure FedAvg's (a device whose
trained head breaks max_abs_param declines), a clipped Δc's entries within its L2 norm. The
group's Σ Δc is checked against |S| · control_clip_norm (what clipped members can send); a sum
beyond it is discarded, nothing applied (``GroupSumOutOfBound``). No DP (as plain Scaffold).
What the sum check cannot do: bound one member's Δc by C. The server sees only Σ Δc, so a modified
member whose partners' Δc are small may send up to |S|·C and move c by up to |S|·C/K, |S| times
what plain Scaffold's per-device clip allows (C/K); only per-member range proofs would close that.
The head part and the count are checked as secure FedAvg's (``SecureFedAvgJob._check_group_sum``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.clipping import global_norm
from protocols.payloads.secagg import SECURE_SCAFFOLD_KIND, controlled_length, unpack_controlled_sum
from protocols.rounds import RoundClosed

from aggregator.jobs.scaffold import ScaffoldConfig, ScaffoldJob
from aggregator.jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob
from aggregator.jobs.secure_rounds import GroupSumOutOfBound


@dataclass
class SecureScaffoldConfig(SecureFedAvgConfig, ScaffoldConfig):
    job_id: str = "scaffold-secure"
    pack_length = staticmethod(controlled_length)         # [n·y | Δc | n]


def check_control_sum(deltas: dict[str, np.ndarray], members: int, clip_norm: float) -> None:
    """GroupSumOutOfBound unless ‖Σ Δc_k‖ ≤ |S| · C: what ``members`` devices that clipped
    ‖Δc_k‖ ≤ C can send."""
    norm = global_norm(deltas)
    if norm > members * clip_norm * (1 + 1e-5) + 1e-4:          # the fixed-point sum's rounding
        raise GroupSumOutOfBound(f"‖Σ Δc_k‖ = {norm:.4g} exceeds |S|·C = {members * clip_norm:.4g} "
                                 f"(|S|={members}, C={clip_norm})")


class SecureScaffoldJob(SecureFedAvgJob, ScaffoldJob):
    secure_kind = SECURE_SCAFFOLD_KIND

    def __init__(self, config: SecureScaffoldConfig, initial_head: dict[str, np.ndarray] | None = None,
                 identity=None, registry=None):
        super().__init__(config, initial_head=initial_head, identity=identity, registry=registry)
        self.bound = max(self.bound, float(config.control_clip_norm))
        self._control_sum: tuple[dict[str, np.ndarray], int] | None = None    # (Σ Δc, |S|) of the round

    def secure_task_fields(self) -> dict:
        return {"control_clip_norm": self.config.control_clip_norm}

    def on_secure_sum(self, total: np.ndarray, survivors: tuple[str, ...]) -> None:
        sums, deltas, n = unpack_controlled_sum(total, self.trained_shapes())
        check_control_sum(deltas, len(survivors), self.config.control_clip_norm)     # before anything is kept
        self.record_sum(sums, n, survivors)
        self._control_sum = (deltas, len(survivors))

    def control_step(self) -> None:
        """c ← c + (|S| / K) · mean(Δc) from the group's sum (a failed round moves nothing)."""
        if self._control_sum is not None:
            self.step_control(*self._control_sum)

    def close_round(self, closed: RoundClosed) -> None:
        super().close_round(closed)
        self._control_sum = None
