"""A partial-personalization job (Phase 3 of the Fed3R paper's pipeline): FedSim or FedAlt.

The head ψ = (weight, bias) is split (``protocols.payloads.partial``): u = weight is shared and
averaged like FedAvg(ψ)'s head; v_k = bias is each device's own, kept in its state store
(``edge_client.state``) and never sent. Everything else is :class:`~aggregator.jobs.fedavg.FedAvgJob`'s:
sampling κ devices a round, deadlines, bounded influence, DP, the server step (FedAvg/FedAvgM on
u), Fed3R initialisation (``from_fed3r``: u and the global v start at the Fed3R classifier).

The job's ``bias`` is the global v: what a device starts its v_k from (first time, or after its
stored v_k went stale); it never moves. Each result also reports held-out counts, so the job
reports the held-out WMA of (u, v_k) — each device with its own personal part — and of (u,
global v), from each device's latest report (``personal_wma``, ``global_wma``). The OLL job that
follows (``personalize`` with ``personal_job``) evaluates every device with its own v_k at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.envelope import Envelope, body_field
from protocols.payloads.partial import ALGORITHMS, KIND, SHARED, PartialParams, PartialUpdate, parse_partial_update

from aggregator.compute.evaluation import weighted_mean_accuracy
from aggregator.jobs.device_state_fields import DeviceStateFields, DeviceStateRun, StatefulDevicesJob
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob, RoundUpdate
from aggregator.jobs.personalize import load_model


@dataclass
class PartialConfig(FedAvgConfig, DeviceStateFields):
    job_id: str = "pp"
    pp_algorithm: str = "fedalt"        # "fedsim": u and v_k together; "fedalt": v_k, then u
    personal_epochs: int = 1            # FedAlt: epochs on v_k before local_epochs on u

    def __post_init__(self):
        super().__post_init__()
        self.check_device_state()
        if self.pp_algorithm not in ALGORITHMS:
            raise ValueError(f"pp_algorithm must be one of {ALGORITHMS}, got {self.pp_algorithm!r}")
        if isinstance(self.personal_epochs, bool) or not isinstance(self.personal_epochs, int) \
                or self.personal_epochs < 0:
            raise ValueError(f"personal_epochs must be an integer >= 0, got {self.personal_epochs!r}")


class PartialPersonalizationJob(StatefulDevicesJob, FedAvgJob):
    """FedSim / FedAlt with personal v_k = bias on the devices (see the module docstring)."""

    def __init__(self, config: PartialConfig, initial_head: dict[str, np.ndarray] | None = None, strategy=None):
        if initial_head is None and config.initial_head_file:
            # a Fed3R model (coef, intercept) or a fine-tuned one (weight, bias): PP after Fed3R or after FT
            initial_head, tail = load_model(config.initial_head_file)
            if tail:
                raise ValueError("partial personalization of the head cannot start from a fine-tuned backbone tail")
        super().__init__(config, initial_head=initial_head, strategy=strategy, kind=KIND)
        self.device_state = DeviceStateRun()
        self.heldout: dict[str, tuple[int, int, int]] = {}     # device -> (n_test, correct, correct_global), latest

    def task_params(self, device: str) -> PartialParams:
        c = self.config
        return PartialParams.extending(super().task_params(device), algorithm=c.pp_algorithm,
                                       personal_epochs=c.personal_epochs, job_id=c.job_id,
                                       state=c.binding(self.device_state.run, self.round))

    def trained_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.params[name].shape for name in SHARED}

    def parse_result(self, env: Envelope) -> RoundUpdate:
        update = parse_partial_update(env, self.config.num_classes, self.config.feature_dim)
        return RoundUpdate(body_field(env, "round", int), update)

    def apply(self, device: str, payload: RoundUpdate) -> None:
        accepted = payload.round == self.round and device not in self._updates
        super().apply(device, payload)
        update: PartialUpdate = payload.update
        if accepted and device in self._updates and update.n_test:
            self.heldout[device] = (update.n_test, update.correct, update.correct_global)

    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        """FedAvgJob's report (``accuracy``: the shared u with the global v on the evaluation
        set) plus the held-out WMA with each device's own v_k and with the global v."""
        out = super().evaluate(features, labels)
        if self.heldout:
            reports = [self.heldout[d] for d in sorted(self.heldout)]
            totals = [n for n, _, _ in reports]
            out["personal_wma"] = weighted_mean_accuracy([c for _, c, _ in reports], totals)
            out["global_wma"] = weighted_mean_accuracy([g for _, _, g in reports], totals)
            out["heldout_devices"] = len(reports)
        return out

    def bookkeeping(self) -> dict:
        """With the held-out reports of the rounds closed so far (JSON, stored at each round open):
        a restarted job reports the same WMA; the open round's reports come back with its replay."""
        return {**super().bookkeeping(), "heldout": {d: list(r) for d, r in sorted(self.heldout.items())}}

    def restore_bookkeeping(self, state: dict) -> None:
        super().restore_bookkeeping(state)
        stored = {str(d): tuple(int(x) for x in r) for d, r in (state.get("heldout") or {}).items()}
        self.heldout = {**stored, **self.heldout}       # reports replayed into the open round are newer
