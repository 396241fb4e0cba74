"""Payload of ``scaffold.head`` and ``scaffold.tail`` tasks and results: Scaffold (Karimireddy et
al. 2020, option II) on the linear head, and on the backbone's tail (FT(φ), FT(M)).

Task (aggregator -> device): tensors ``weight`` (C, d), ``bias`` (C,) (the global head w) and
``control.weight``, ``control.bias`` (the server control c); ``params``: the model fields,
``feature_dim``, the local recipe of ``fedavg.head`` (epochs, batch_size, lr, weight_decay,
temperature, seed), ``job_id`` and the state binding (``protocols.payloads.stateful``).

The device keeps its control c_k in its state store (0 the first time, and after it went stale),
takes K local steps y ← y − lr (∇f_k(y) + wd·y − c_k + c) and sets
c_k⁺ = c_k − c + (w − y) / (K lr).

Result (device -> aggregator): tensors ``weight``, ``bias`` (y: the trained head; the server's
Δy = y − w) and ``delta_control.weight``, ``delta_control.bias`` (Δc = c_k⁺ − c_k), float32 and
finite, ``n`` in the body: twice FedAvg(ψ)'s upload.

``scaffold.tail`` is the same on ``fedavg.tail``'s model (params: ``fedavg.tail``'s plus
``job_id`` and ``state``): the task carries the whole model (``tail.<...>``, ``weight``, ``bias``)
and ``control.<name>`` for each tensor the device trains (the tail for ``train = "tail"``, tail
and head for ``"tail+head"``); the result is those tensors (y) and ``delta_control.<name>``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..envelope import Envelope
from .fedavg import TailTrainingParams, parse_model_update
from .stateful import StatefulHeadParams

KIND = "scaffold.head"
KIND_TAIL = "scaffold.tail"
CONTROL = "control."                 # the server control c, in a task
DELTA_CONTROL = "delta_control."     # the device's Δc, in a result
HEAD = ("weight", "bias")


@dataclass(frozen=True)
class ScaffoldParams(StatefulHeadParams):
    """``scaffold.head`` params: a stateful head task's (the device keeps c_k under the binding)."""

    KIND = KIND


@dataclass(frozen=True)
class ScaffoldTailParams(StatefulHeadParams, TailTrainingParams):
    """``scaffold.tail`` params: ``fedavg.tail``'s (the split, what trains) plus the stateful task's
    ``job_id`` and ``state`` (the device keeps c_k, over the tensors it trains, under the binding)."""

    KIND = KIND_TAIL


@dataclass(frozen=True)
class ScaffoldUpdate:
    n: int
    head: dict[str, np.ndarray]            # y: the trained tensors (the head; on the tail, the tail [+ head])
    delta_control: dict[str, np.ndarray]   # Δc, by trained tensor name

    def tensors(self) -> dict[str, np.ndarray]:
        return dict(self.head)


def parse_scaffold_update(msg: Envelope, num_classes: int, feature_dim: int,
                          max_samples: int = 10**9) -> ScaffoldUpdate:
    """Validate a ``scaffold.head`` result (exactly y and Δc, float32, finite); EnvelopeError otherwise."""
    return parse_control_update(msg, {"weight": (num_classes, feature_dim), "bias": (num_classes,)}, max_samples)


def parse_control_update(msg: Envelope, trained: dict[str, tuple[int, ...]],
                         max_samples: int = 10**9) -> ScaffoldUpdate:
    """Validate a Scaffold result over the ``trained`` tensors (exactly y and Δc of each, float32,
    finite); EnvelopeError otherwise."""
    shapes = {**trained, **{DELTA_CONTROL + name: shape for name, shape in trained.items()}}
    update = parse_model_update(msg, shapes, max_samples)
    t = update.trained
    return ScaffoldUpdate(update.n, {k: t[k] for k in trained}, {k: t[DELTA_CONTROL + k] for k in trained})
