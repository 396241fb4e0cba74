"""Ditto (Li et al. 2021) on the head: FedAvg(ψ) plus a personal head on every device.

The global head ψ is :class:`~aggregator.jobs.fedavg.FedAvgJob`'s in every respect (sampling,
deadlines, bounded influence, the server step FedAvg/FedAvgM/FedOpt, DP, Fed3R initialisation):
each device's upload is its locally trained ψ_k, as in ``fedavg.head``. Each device also trains
its own head v_k on f_k(v_k) + λ/2‖v_k − ψ‖², ψ the round's global head, and keeps it in its
state store (``edge_client/tasks/ditto_training.py``); v_k never leaves the device. A device
sampled again after more than ``state_max_staleness`` rounds (or the first time) starts v_k from ψ.

Each result also reports held-out counts with v_k and with ψ, so the job reports the held-out
WMA of the devices' personal heads and of the global head (``personal_wma``, ``global_wma``;
``aggregator/jobs/personal_wma.py``), as the partial-personalization job does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.envelope import Envelope, body_field
from protocols.payloads.ditto import KIND, DittoParams, DittoRecipe, parse_ditto_update

from aggregator.jobs.config_limits import PERSONAL_EPOCHS, Range, limited
from aggregator.jobs.device_state_fields import DeviceStateFields, DeviceStateRun, StatefulDevicesJob
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob, RoundUpdate
from aggregator.jobs.personal_wma import HeldoutReportFields, PersonalWmaJob
from aggregator.jobs.personalize import load_head


@dataclass
class DittoConfig(FedAvgConfig, DeviceStateFields, HeldoutReportFields):
    job_id: str = "ditto"
    # λ, the personal head's pull to the global one (the paper's code: 0.1)
    ditto_lambda: float = limited(0.1, Range(1e-9, 1e4))
    personal_epochs: int = limited(1, PERSONAL_EPOCHS)       # epochs of the personal pass per round
    # its learning rate; 0: the global pass's (client_lr, × 0.1 after Fed3R)
    personal_lr: float = limited(0.0, Range(0, 100))

    def __post_init__(self):
        super().__post_init__()
        self.check_device_state()
        if isinstance(self.personal_lr, bool) or not isinstance(self.personal_lr, (int, float)) \
                or not 0 <= self.personal_lr <= 100:
            raise ValueError(f"personal_lr must be a number in [0, 100] (0: the devices' lr), got {self.personal_lr!r}")
        self.ditto_recipe()

    def ditto_recipe(self) -> DittoRecipe:
        """What every task carries (its checks run when the config is created)."""
        return DittoRecipe(self.ditto_lambda, self.personal_epochs, self.personal_lr or self.device_lr)


class DittoJob(PersonalWmaJob, StatefulDevicesJob, FedAvgJob):
    """FedAvg(ψ) whose devices also keep a personal head (see the module docstring)."""

    def __init__(self, config: DittoConfig, initial_head: dict[str, np.ndarray] | None = None, strategy=None):
        if initial_head is None and config.initial_head_file:
            initial_head = load_head(config.initial_head_file, "Ditto")    # after Fed3R or after FT(ψ)
        super().__init__(config, initial_head=initial_head, strategy=strategy, kind=KIND)
        self.device_state = DeviceStateRun()

    def task_params(self, device: str) -> DittoParams:
        c, ditto = self.config, self.config.ditto_recipe()
        return DittoParams.extending(super().task_params(device), job_id=c.job_id,
                                     state=c.binding(self.device_state.run, self.round),
                                     ditto_lambda=ditto.ditto_lambda, personal_epochs=ditto.personal_epochs,
                                     personal_lr=ditto.personal_lr)

    def parse_result(self, env: Envelope) -> RoundUpdate:
        update = parse_ditto_update(env, self.config.num_classes, self.config.feature_dim)
        return RoundUpdate(body_field(env, "round", int), update)
