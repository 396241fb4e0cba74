"""``scaffold.head``: Scaffold's local pass on the head, with the device's control c_k kept in its
state store (``protocols.payloads.scaffold``; spec: ``learning_after_fed3r.md``, Phase 2).

Each step is ``fedavg.head``'s numpy step (temperature-scaled cross-entropy, L2 weight decay)
followed by the control correction −lr (c − c_k), i.e. y ← y − lr (∇f_k(y) + wd·y − c_k + c).
After the K steps, option II: c_k⁺ = c_k − c + (w − y) / (K lr). The device stores c_k⁺ (with
the c_k it started from, so a redelivered task starts there again) before it sends y and
Δc = c_k⁺ − c_k. A device with no usable c_k (first time, another run's, stale) starts from 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.payloads.fedavg import encode_model_update, raise_if_diverged
from protocols.payloads.fedavg import LocalTraining
from protocols.payloads.scaffold import CONTROL, DELTA_CONTROL, HEAD, KIND, ScaffoldParams

from ..agent import TaskDeclined
from .numpy_head import NumpyHeadStepper, batch_schedule, head_size
from .stateful_head import StatefulHeadTask


def control_correction(control: dict[str, np.ndarray], device_control: dict[str, np.ndarray],
                       lr: float = 1.0) -> dict[str, np.ndarray]:
    """lr (c − c_k), float32: what option II subtracts from each local step beyond the gradient's."""
    return {k: (np.asarray(control[k], np.float32) - np.asarray(device_control[k], np.float32)) * np.float32(lr)
            for k in control}


def option_ii_control(control: dict[str, np.ndarray], device_control: dict[str, np.ndarray],
                      start: dict[str, np.ndarray], y: dict[str, np.ndarray], steps: int,
                      lr: float) -> dict[str, np.ndarray]:
    """c_k⁺ = c_k − c + (x − y) / (K lr), K the local steps taken; FloatingPointError if it or y diverged."""
    scale = np.float32(1.0 / (steps * lr))
    new_control = {k: (np.asarray(device_control[k], np.float32) - np.asarray(control[k], np.float32)
                       + (np.asarray(start[k], np.float32) - y[k]) * scale) for k in control}
    raise_if_diverged({**y, **{f"control.{k}": v for k, v in new_control.items()}})
    return new_control


def read_control(tensors: dict[str, np.ndarray] | None, shapes: dict[str, tuple[int, ...]],
                 kind: str) -> dict[str, np.ndarray]:
    """The task's server control c (``control.<name>`` for each trained tensor), declined unless
    finite float32 shaped like the tensor it controls."""
    control = {k: np.asarray((tensors or {}).get(CONTROL + k)) for k in shapes}
    if any(control[k].shape != tuple(shapes[k]) or control[k].dtype != np.float32
           or not np.isfinite(control[k]).all() for k in shapes):
        raise TaskDeclined(f"{kind} task must carry finite float32 {' and '.join(CONTROL + k for k in shapes)} "
                           "shaped like the tensors they control")
    return control


def scaffold_pass(weight: np.ndarray, bias: np.ndarray, control: dict[str, np.ndarray],
                  device_control: dict[str, np.ndarray], features: np.ndarray, labels: np.ndarray,
                  recipe: LocalTraining) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(y, c_k⁺): the K corrected local steps from w = (weight, bias) and option II's new control."""
    stepper = NumpyHeadStepper(weight, bias, recipe)
    correction = control_correction({k: control[k] for k in HEAD}, device_control, recipe.lr)
    batches = batch_schedule(len(labels), recipe, head_size(weight, bias))
    for batch in batches:
        stepper.step(features[batch], labels[batch])
        stepper.weight -= correction["weight"]
        stepper.bias -= correction["bias"]
    y = stepper.parameters()
    start = {"weight": weight, "bias": bias}
    return y, option_ii_control({k: control[k] for k in HEAD}, device_control, start, y, len(batches), recipe.lr)


class ScaffoldTrainingTask(StatefulHeadTask):
    """Handler for ``scaffold.head``: ``(params, tensors) -> (body, y and Δc)``."""

    kind = KIND
    params_type = ScaffoldParams

    def __call__(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None = None):
        task = self.read(params, tensors)
        recipe = task.params.training
        head = {"weight": task.weight, "bias": task.bias}
        control = read_control(tensors, {k: v.shape for k, v in head.items()}, KIND)
        self.admit(task, head)
        shapes = {k: v.shape for k, v in head.items()}
        stored, replaced = self.stored_values(task, shapes)      # replaced: a stale c_k, restarted
        start = stored if stored is not None else {k: np.zeros_like(v) for k, v in head.items()}
        try:
            y, new_control = scaffold_pass(task.weight, task.bias, control, start, task.features, self.labels,
                                           recipe)
        except FloatingPointError as exc:
            raise TaskDeclined(str(exc)) from exc
        counted = replaced if replaced is not None else start      # the c_k the server's c holds for this device
        delta = {DELTA_CONTROL + k: new_control[k] - counted[k] for k in HEAD}
        # encoded before c_k is kept: a result the wire refuses (a Δc past its bound) declines the
        # task with the state as it was, never a c_k the server's c did not count (a review's finding)
        body, out = encode_model_update({**y, **delta}, len(self.labels))
        self.keep(task, stored, new_control, replaced)
        return {**body, "restarted": stored is None}, out
