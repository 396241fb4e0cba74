"""``scaffold.tail``: Scaffold (option II) on the backbone's tail, i.e. FT(φ)/FT(M) corrected by
control variates (``protocols.payloads.scaffold``), with the device's c_k kept in its state store.

Everything about the tail (the bundle's checks, the trunk's activations, the seeded mini-batches,
weight decay) is :class:`~edge_client.tasks.tail_training.TailTrainingTask`'s. The tail program
takes one plain SGD step per call (p ← p − lr·d for the direction d it is given), so Scaffold's
corrected step y ← y − lr (g + wd·y − c_k + c) is each step's direction plus the constant c − c_k
(``SessionStepper``'s ``correction``). After the K steps, c_k⁺ = c_k − c + (x − y) / (K lr), and the
state store's rules are ``scaffold.head``'s (``edge_client/tasks/scaffold_training.py``): c_k over
the trained tensors, stored with the value it started from before the result goes out; none,
another run's or stale: c_k = 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.payloads.fedavg import encode_model_update
from protocols.payloads.scaffold import CONTROL, DELTA_CONTROL, KIND_TAIL, ScaffoldTailParams

from ..agent import TaskDeclined
from ..state import DeviceStateStore
from .scaffold_training import option_ii_control, read_control
from .stateful_head import DeviceStateKeeper, StateKey
from .tail_training import TailTrainingTask


class ScaffoldTailTask(TailTrainingTask, DeviceStateKeeper):
    """Handler for ``scaffold.tail``: ``(params, tensors) -> (body, y and Δc of the trained tensors)``.
    The arguments are TailTrainingTask's plus the device's state store (None: it declines)."""

    kind = KIND_TAIL
    params_type = ScaffoldTailParams

    def __init__(self, images: np.ndarray, labels: np.ndarray, manifest, store: DeviceStateStore | None,
                 trunk=None, cache_dir: str | None = None, session=None):
        super().__init__(images, labels, manifest, trunk=trunk, cache_dir=cache_dir, session=session)
        self.store = store

    def __call__(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None = None):
        self.require_store()
        tensors = tensors or {}
        model = {k: v for k, v in tensors.items() if not k.startswith(CONTROL)}
        job = self.prepare(params, model, ScaffoldTailParams, KIND_TAIL)
        shapes = {name: job.start[name].shape for name in sorted(job.trained)}
        control = read_control(tensors, shapes, KIND_TAIL)
        key = StateKey(job.params.job_id, job.params.state)
        self.admit(key, control)
        stored, replaced = self.stored_values(key, shapes)       # replaced: a stale c_k, restarted
        ck = stored if stored is not None else {k: np.zeros(s, np.float32) for k, s in shapes.items()}
        y = self.train(job, correction={k: control[k] - ck[k] for k in shapes})     # c − c_k, every step
        try:
            new_ck = option_ii_control(control, ck, job.start, y, self.last_steps, job.params.training.lr)
        except FloatingPointError as exc:
            raise TaskDeclined(str(exc)) from exc
        counted = replaced if replaced is not None else ck          # the c_k the server's c holds (as the head's)
        delta = {DELTA_CONTROL + k: new_ck[k] - counted[k] for k in shapes}
        body, out = encode_model_update({**y, **delta}, len(self.labels))     # before c_k is kept (as the head's)
        self.keep(key, stored, new_ck, replaced)
        return {**body, "restarted": stored is None}, out
