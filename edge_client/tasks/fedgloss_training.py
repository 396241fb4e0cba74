"""``fedgloss.head``: FedGloSS's local pass on the head (thesis Alg. 5, lines 8-20), with the
device's ADMM dual σ_k kept in its state store (``protocols.payloads.fedgloss``).

The pass starts from the perturbed global head w̃ the task carries and takes ``fedavg.head``'s
numpy steps with the job's local rule (SGD, FedSAM, FedASAM, FedProx) wrapped in
:class:`~edge_client.tasks.local_rules.AdmmDual`: w ← w − lr (d − σ_k + (w − w̃)/β + wd·w). Then
σ_k ← σ_k − (w_E − w̃)/β. The device stores σ_k (with the σ_k it started from, so a redelivered
task starts there again) before it sends w_E, FedAvg's upload. A device with no usable σ_k
(first time, another run's, stale) starts from 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.payloads.fedavg import encode_head_update, raise_if_diverged
from protocols.payloads.fedavg import LocalTraining
from protocols.payloads.fedgloss import KIND, FedGlossParams

from ..agent import TaskDeclined
from .local_rules import AdmmDual
from .numpy_head import NumpyHeadStepper, batch_schedule, head_size
from .stateful_head import StatefulHeadTask


def fedgloss_pass(weight: np.ndarray, bias: np.ndarray, dual: dict[str, np.ndarray], features: np.ndarray,
                  labels: np.ndarray, recipe: LocalTraining,
                  beta: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(w_E, σ_k⁺): the local ADMM steps from w̃ = (weight, bias) and the dual's update."""
    stepper = NumpyHeadStepper(weight, bias, recipe)
    stepper.rule = AdmmDual(beta, dual, stepper.rule)
    for batch in batch_schedule(len(labels), recipe, head_size(weight, bias)):
        stepper.step(features[batch], labels[batch])
    trained = stepper.parameters()
    new_dual = {k: (np.asarray(dual[k], np.float64)
                    - (trained[k].astype(np.float64) - stepper.start[k].astype(np.float64)) / beta).astype(np.float32)
                for k in trained}
    raise_if_diverged({**trained, **{f"dual.{k}": v for k, v in new_dual.items()}})
    return trained, new_dual


class FedGlossTrainingTask(StatefulHeadTask):
    """Handler for ``fedgloss.head``: ``(params, tensors) -> (body, the trained head)``."""

    kind = KIND
    params_type = FedGlossParams

    def __call__(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None = None):
        task = self.read(params, tensors)
        recipe, admm = task.params.training, task.params.admm
        head = {"weight": task.weight, "bias": task.bias}
        self.admit(task, head)
        shapes = {k: v.shape for k, v in head.items()}
        # σ_k is kept whatever its age (as ADMM keeps it): the server infers each device's Δσ_k from
        # its head, so its σ stays the mean of the devices' duals only if none restarts (a restart
        # could not be taken back out of σ; with restarts after every round σ drifted 2x its norm)
        stored, stale = self.stored_values(task, shapes)
        stored = stored if stored is not None else stale
        start = stored if stored is not None else {k: np.zeros_like(v) for k, v in head.items()}
        try:
            trained, new_dual = fedgloss_pass(task.weight, task.bias, start, task.features, self.labels, recipe,
                                              admm.admm_beta)
            body, out = encode_head_update(trained["weight"], trained["bias"], len(self.labels))
        except (FloatingPointError, ValueError) as exc:       # diverged, or outside the wire's bound
            raise TaskDeclined(str(exc)) from exc
        self.keep(task, stored, new_dual)
        return {**body, "restarted": stored is None}, out
