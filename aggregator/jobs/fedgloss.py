"""FedGloSS(ψ) (Caldarola et al., thesis §4.4, Alg. 5): server-side SAM on the head, with ADMM, at
FedAvg's traffic.

Everything is :class:`~aggregator.jobs.fedavg.FedAvgJob`'s (sampling, deadlines, bounded
influence, Fed3R initialisation, the served model); the server step is
:class:`~aggregator.strategies.fedgloss.FedGlossServer` (Δ̃ᵗ⁻¹ and the global dual σ, checkpointed
with the model). Each task carries the perturbed head w̃ = w + ρ Δ̃ᵗ⁻¹/‖Δ̃ᵗ⁻¹‖ instead of w, and
the ADMM β; each device keeps its dual σ_k in its state store
(``edge_client/tasks/fedgloss_training.py``) and returns its trained head, as in FedAvg. The
bounded-influence layers measure each update from w̃, the point it was trained from.

σ's step weighs the round by |Cᵗ|/K, K the fleet's size (``total_devices``; 0: the devices
that contributed so far, a lower bound that grows as the job meets its fleet), as Scaffold's c;
|Cᵗ| counts the updates in the round's mean (not those the direction screen left out).
A device not sampled keeps its σ_k (at the device); one sampled again after more than
``state_max_staleness`` rounds restarts from σ_k = 0 (``aggregator/jobs/device_state_fields.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.payloads.fedgloss import KIND, AdmmRecipe, FedGlossParams

from aggregator.jobs.config_limits import TOTAL_DEVICES, Range, check_whole_number, limited
from aggregator.jobs.device_state_fields import DeviceStateFields, DeviceStateRun, StatefulDevicesJob
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.strategies.fedgloss import FedGlossServer


@dataclass
class FedGlossConfig(FedAvgConfig, DeviceStateFields):
    job_id: str = "fedgloss"
    fedgloss_rho: float = limited(0.01, Range(0, 100))  # the server's ascent radius ρ (thesis: 0.01-0.15, < 0.2)
    admm_beta: float = limited(10.0, Range(1e-9, 1e6))  # ADMM's β, on the server and every device (thesis: 10)
    total_devices: int = limited(0, TOTAL_DEVICES)      # K in σ's step; 0: the devices that contributed so far

    def __post_init__(self):
        AdmmRecipe(self.admm_beta)       # before super(): its server step is built from it
        super().__post_init__()
        self.check_device_state()
        if self.dp:
            raise ValueError("FedGloSS's duals are outside DP-FedAvg's accounting: no dp with fedgloss")
        check_whole_number(self, "total_devices", 0)
        if self.server_optimizer != "sgd" or self.server_momentum:
            raise ValueError("fedgloss is its own server step: server_optimizer must be 'sgd' and "
                             "server_momentum 0 (server_lr is its η)")

    def server_step(self) -> FedGlossServer:
        return FedGlossServer(self.fedgloss_rho, self.admm_beta, self.server_lr)


class FedGlossJob(StatefulDevicesJob, FedAvgJob):
    """FedGloSS on the head: FedAvgJob sending w̃ and stepping with FedGlossServer."""

    strategy: FedGlossServer

    def __init__(self, config: FedGlossConfig, initial_head: dict[str, np.ndarray] | None = None, strategy=None):
        super().__init__(config, initial_head=initial_head, strategy=strategy, kind=KIND)
        self.device_state = DeviceStateRun()

    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        return self.task_params(device).to_params(), self.round_start()

    def task_params(self, device: str) -> FedGlossParams:
        c = self.config
        return FedGlossParams.extending(super().task_params(device), job_id=c.job_id,
                                        state=c.binding(self.device_state.run, self.round), admm=AdmmRecipe(c.admm_beta))

    def round_start(self) -> dict[str, np.ndarray]:
        return self.strategy.perturbed(self.params)          # w̃ᵗ: what this round's devices start from

    def round_step(self) -> tuple[dict[str, np.ndarray] | None, int, int]:
        """FedAvg's round step (FedGloSS runs no DP), p counted over the updates in the mean: the
        devices the direction screen left out (``left_out``, which Scaffold's c step leaves out too)
        are no more of this round's σ step than of its mean. Counted before ``round_mean``, whose
        close observes the round: the small-round reference it then holds is not the one the mean
        was bounded by (Scaffold's c step runs before it too)."""
        in_mean = len(self._updates) - len(self.left_out())
        return self.step_over(*self.round_mean(), in_mean)

    def server_step(self, mean: dict[str, np.ndarray] | None, updates: int, samples: int):
        """A sharded coordinator's step on its shards' sums: every accepted update is in their mean
        (shards refuse the direction screen, ``needs_every_update``)."""
        return self.step_over(mean, updates, samples, updates)

    def step_over(self, mean: dict[str, np.ndarray] | None, updates: int, samples: int, in_mean: int):
        """FedGlossServer's step from the round's mean of ``in_mean`` of its ``updates`` (p = |Cᵗ|/K
        over those), the history measured from w̃ᵗ."""
        if mean is None:
            return None, 0, 0
        current = {name: self.params[name] for name in mean}
        moved = self.strategy.step(current, self.history.step(self.round_start(), mean), self.participation(in_mean))
        return moved, updates, samples
