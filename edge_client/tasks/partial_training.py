"""``pp.head``: FedSim / FedAlt partial personalization of the head (``protocols.payloads.partial``).

The head ψ = (weight, bias) is split: u = weight is shared (trained here, sent back, averaged by
the server), v_k = bias is the device's own (kept in its state store, never sent). Per task:

1. v_k from the store (first time, another run's or stale state: the task's global ``bias``);
2. FedSim: ``epochs`` epochs of SGD on (u, v_k) together; FedAlt: ``personal_epochs`` epochs on
   v_k with u fixed, then ``epochs`` epochs on u with v_k fixed (the two phases take the
   mini-batches of ``batch_schedule(seed)`` and ``batch_schedule(seed + 1)``);
3. v_k stored, then the held-out split scored with (the task's u, v_k) and (the task's u, the
   global bias), and u sent back with n.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.payloads.fedavg import raise_if_diverged
from protocols.payloads.partial import KIND, PartialParams, PartialRecipe, encode_partial_update

from ..agent import TaskDeclined
from .numpy_head import TrainingPass, head_sgd_step, head_size, schedule, within_passes_budget
from .stateful_head import StatefulHeadTask


def sgd_epochs(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray,
               recipe: PartialRecipe, epochs: int, seed: int, train: tuple[str, ...]) -> int:
    """``epochs`` seeded epochs of mini-batch SGD moving, in place, only the tensors in ``train``
    ("weight", "bias"); the others are held fixed. Returns the steps taken."""
    lr, T, wd = np.float32(recipe.lr), np.float32(recipe.temperature), np.float32(recipe.weight_decay)
    batches = schedule(len(labels), epochs, recipe.batch_size, seed, head_size(weight, bias)) if epochs else []
    for batch in batches:
        # a fixed tensor takes its step on a scratch copy, which is thrown away
        w = weight if "weight" in train else weight.copy()
        b = bias if "bias" in train else bias.copy()
        share = np.full(len(batch), 1.0 / len(batch), dtype=np.float32)
        head_sgd_step(w, b, features[batch], labels[batch], share, lr, T, wd)
    return len(batches)


def train_partial(weight: np.ndarray, personal_bias: np.ndarray, features: np.ndarray, labels: np.ndarray,
                  recipe: PartialRecipe) -> tuple[np.ndarray, np.ndarray]:
    """(u, v_k) after one FedSim or FedAlt local pass from (``weight``, ``personal_bias``)."""
    u = np.array(weight, dtype=np.float32)
    v = np.array(personal_bias, dtype=np.float32)
    features = np.ascontiguousarray(features, dtype=np.float32)
    labels = np.asarray(labels, dtype=np.int64)
    if recipe.algorithm == "fedsim":
        sgd_epochs(u, v, features, labels, recipe, recipe.epochs, recipe.seed, ("weight", "bias"))
    else:
        rows, batch_size, size = len(labels), recipe.batch_size, head_size(u, v)
        within_passes_budget([TrainingPass(rows, recipe.personal_epochs, batch_size, size),
                              TrainingPass(rows, recipe.epochs, batch_size, size)],
                             f"FedAlt's personal pass of {recipe.personal_epochs} epochs and shared pass of "
                             f"{recipe.epochs} epochs over {rows} samples in batches of {batch_size}")
        sgd_epochs(u, v, features, labels, recipe, recipe.personal_epochs, recipe.seed, ("bias",))
        sgd_epochs(u, v, features, labels, recipe, recipe.epochs, (recipe.seed + 1) % 2**32, ("weight",))
    raise_if_diverged({"weight": u, "bias": v})
    return u, v


class PartialTrainingTask(StatefulHeadTask):
    """Handler for ``pp.head``: ``(params, tensors) -> (body, {"weight": u})``."""

    kind = KIND
    params_type = PartialParams

    def __call__(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None = None):
        task = self.read(params, tensors)
        recipe = task.params.recipe()
        self.admit(task, {"bias": task.bias})
        stored = self.start_value(task, {"bias": task.bias.shape})
        start = stored["bias"] if stored is not None else task.bias
        try:
            u, v = train_partial(task.weight, start, task.features, self.labels, recipe)
        except FloatingPointError as exc:
            raise TaskDeclined(str(exc)) from exc
        result = encode_partial_update(u, len(self.labels), self.personal_report(
            task, {"weight": task.weight, "bias": v}, stored is None))
        self.keep(task, stored, {"bias": v})          # once the result is encoded (a refused one keeps v_k as it was)
        return result
