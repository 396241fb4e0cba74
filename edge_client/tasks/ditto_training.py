"""``ditto.head``: Ditto (Li et al. 2021) on the head, with the device's personal head v_k kept in
its state store (``protocols.payloads.ditto``; spec: ``learning_after_fed3r.md``, Phase 4).

Per task, from the task's global head ψ:

1. the global pass: ``fedavg.head``'s numpy steps (the job's local rule) from ψ for ``epochs``
   epochs on ``batch_schedule(seed)``; ψ_k is the upload, averaged by the server as FedAvg's;
2. the personal pass: from v_k (the store's; first time, another run's or stale: ψ), the same
   steps with FedProx's pull μ = λ towards ψ (:class:`~edge_client.tasks.local_rules.Proximal`
   around the job's rule), ``personal_epochs`` epochs at ``personal_lr`` on
   ``batch_schedule(seed + 1)``: v ← v − lr (∇f_k(v) + λ (v − ψ) + wd·v);
3. v_k stored (with the v_k it started from, so a redelivered task starts there again) before
   the result goes out: ψ_k, n, and the held-out counts with v_k and with ψ. v_k is never sent.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from protocols.payloads.ditto import KIND, DittoParams, DittoRecipe, encode_ditto_update
from protocols.payloads.fedavg import raise_if_diverged

from ..agent import TaskDeclined
from .head_training import LocalTraining
from .numpy_head import NumpyHeadStepper, batch_schedule, head_size, recipe_pass, within_passes_budget
from .stateful_head import StatefulHeadTask


def local_pass(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray,
               recipe: LocalTraining, anchor: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The head after ``recipe``'s seeded mini-batch steps from (weight, bias)."""
    stepper = NumpyHeadStepper(weight, bias, recipe, anchor)
    for batch in batch_schedule(len(labels), recipe, head_size(weight, bias)):
        stepper.step(features[batch], labels[batch])
    return stepper.parameters()


def personal_recipe(recipe: LocalTraining, ditto: DittoRecipe) -> LocalTraining:
    """The personal pass's recipe: the job's, with Ditto's epochs and rate, its own batch order,
    and the job's local rule wrapped in FedProx's pull μ = λ (replacing any FedProx μ of the global pass)."""
    return replace(recipe, epochs=ditto.personal_epochs, lr=ditto.personal_lr, seed=(recipe.seed + 1) % 2**32,
                   rule=replace(recipe.rule, prox_mu=ditto.ditto_lambda))


def ditto_pass(weight: np.ndarray, bias: np.ndarray, personal: dict[str, np.ndarray], features: np.ndarray,
               labels: np.ndarray, recipe: LocalTraining,
               ditto: DittoRecipe) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(ψ_k, v_k⁺): the global pass from ψ = (weight, bias) and the personal pass from ``personal``."""
    features = np.ascontiguousarray(features, dtype=np.float32)
    labels = np.asarray(labels, dtype=np.int64)
    mine_recipe = personal_recipe(recipe, ditto)
    rows, batch_size, size = len(labels), recipe.batch_size, head_size(weight, bias)
    within_passes_budget([recipe_pass(rows, recipe, size), recipe_pass(rows, mine_recipe, size)],
                         f"Ditto's global pass of {recipe.epochs} epochs and personal pass of {mine_recipe.epochs} "
                         f"epochs over {rows} samples in batches of {batch_size}")
    trained = local_pass(weight, bias, features, labels, recipe)
    mine = local_pass(personal["weight"], personal["bias"], features, labels, mine_recipe,
                      anchor={"weight": weight, "bias": bias})
    raise_if_diverged({**trained, **{f"personal.{k}": v for k, v in mine.items()}})
    return trained, mine


class DittoTrainingTask(StatefulHeadTask):
    """Handler for ``ditto.head``: ``(params, tensors) -> (body, ψ_k)``."""

    kind = KIND
    params_type = DittoParams

    def __call__(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None = None):
        task = self.read(params, tensors)
        recipe, ditto = task.params.training, task.params.ditto()
        head = {"weight": task.weight, "bias": task.bias}
        self.admit(task, head)
        stored = self.start_value(task, {k: v.shape for k, v in head.items()})
        start = stored if stored is not None else head
        try:
            trained, mine = ditto_pass(task.weight, task.bias, start, task.features, self.labels, recipe, ditto)
            report = self.personal_report(task, mine, stored is None)
            result = encode_ditto_update(trained["weight"], trained["bias"], len(self.labels), report)
        except (FloatingPointError, ValueError) as exc:       # diverged, or outside the wire's bound
            raise TaskDeclined(str(exc)) from exc
        self.keep(task, stored, mine)
        return result
