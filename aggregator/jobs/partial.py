"""A partial-personalization job (Phase 3 of the Fed3R paper's pipeline): FedSim or FedAlt.

The head ψ = (weight, bias) is split (``protocols.payloads.partial``): u = weight is shared and
averaged like FedAvg(ψ)'s head; v_k = bias is each device's own, kept in its state store
(``edge_client.state``) and never sent. Everything else is :class:`~aggregator.jobs.fedavg.FedAvgJob`'s:
sampling κ devices a round, deadlines, bounded influence, DP, the server step (FedAvg/FedAvgM on
u), Fed3R initialisation (``from_fed3r``: u and the global v start at the Fed3R classifier).

The job's ``bias`` is the global v: what a device starts its v_k from (first time, or after its
stored v_k went stale); it never moves. Each result also reports held-out counts, so the job
reports the held-out WMA of (u, v_k) — each device with its own personal part — and of (u,
global v), from each device's latest report (``personal_wma``, ``global_wma``;
``aggregator/jobs/personal_wma.py``). The OLL job that
follows (``personalize`` with ``personal_job``) evaluates every device with its own v_k at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.envelope import Envelope, body_field
from protocols.payloads.partial import ALGORITHMS, KIND, SHARED, PartialParams, parse_partial_update

from aggregator.jobs.config_limits import PERSONAL_EPOCHS, OneOf, check_whole_number, limited
from aggregator.jobs.device_state_fields import DeviceStateFields, DeviceStateRun, StatefulDevicesJob
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob, RoundUpdate
from aggregator.jobs.personal_wma import HeldoutReportFields, PersonalWmaJob
from aggregator.jobs.personalize import load_head


@dataclass
class PartialConfig(FedAvgConfig, DeviceStateFields, HeldoutReportFields):
    job_id: str = "pp"
    pp_algorithm: str = limited("fedalt", OneOf(ALGORITHMS))  # "fedsim": u and v_k together; "fedalt": v_k, then u
    personal_epochs: int = limited(1, PERSONAL_EPOCHS)        # FedAlt: epochs on v_k before local_epochs on u

    def __post_init__(self):
        super().__post_init__()
        self.check_device_state()
        if self.pp_algorithm not in ALGORITHMS:
            raise ValueError(f"pp_algorithm must be one of {ALGORITHMS}, got {self.pp_algorithm!r}")
        check_whole_number(self, "personal_epochs", 0)
        # the device's pp.head step is plain SGD (edge_client/tasks/partial_training.py): a local rule
        # or FedProx's μ would be stored, sent and silently not applied (a review's finding)
        if self.local_rule != "sgd" or self.prox_mu:
            raise ValueError(f"pp trains u and v_k with plain SGD on the device: local_rule {self.local_rule!r} and "
                             f"prox_mu {self.prox_mu} would not be applied (FedAvg, Scaffold, FedGloSS and Ditto "
                             "take them)")

    def trained_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shared part u only: each device's v_k stays on it."""
        return {name: shape for name, shape in super().trained_shapes().items() if name in SHARED}


class PartialPersonalizationJob(PersonalWmaJob, StatefulDevicesJob, FedAvgJob):
    """FedSim / FedAlt with personal v_k = bias on the devices (see the module docstring)."""

    def __init__(self, config: PartialConfig, initial_head: dict[str, np.ndarray] | None = None, strategy=None):
        if initial_head is None and config.initial_head_file:
            # a Fed3R model (coef, intercept) or a fine-tuned one (weight, bias): PP after Fed3R or after FT
            initial_head = load_head(config.initial_head_file, "partial personalization")
        super().__init__(config, initial_head=initial_head, strategy=strategy, kind=KIND)
        self.device_state = DeviceStateRun()

    def task_params(self, device: str) -> PartialParams:
        c = self.config
        return PartialParams.extending(super().task_params(device), algorithm=c.pp_algorithm,
                                       personal_epochs=c.personal_epochs, job_id=c.job_id,
                                       state=c.binding(self.device_state.run, self.round))

    def parse_result(self, env: Envelope) -> RoundUpdate:
        update = parse_partial_update(env, self.config.num_classes, self.config.feature_dim)
        return RoundUpdate(body_field(env, "round", int), update)
