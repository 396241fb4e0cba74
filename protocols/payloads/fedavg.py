"""Payload of ``fedavg.head`` tasks and results: a linear softmax head, trained locally.

Task (aggregator -> device), tensors of the ``task`` message:

* ``weight``  float32 (C, d)  the current global head, ``logits = f @ weight.T + bias``
* ``bias``    float32 (C,)

and in ``params`` the local-training recipe (see ``aggregator.jobs.fedavg.FedAvgConfig``).

Result (device -> aggregator), tensors of the ``result`` message:

* ``weight``  float32 (C, d)  the head after the device's local epochs (the parameters
                              themselves, not a difference: averaging parameters is FedAvg)
* ``bias``    float32 (C,)

and in the body ``n`` (local training samples, the FedAvg weight n_k), ``num_classes`` and
``feature_dim``. Both directions carry exactly C·d + C float32 values, so a round costs
2·(C·d + C)·4 bytes per participant plus headers (the "2dC" of the Fed3R paper's cost model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..envelope import Envelope, EnvelopeError, body_field, require_finite, require_tensor

KIND = "fedavg.head"
HEAD_TENSORS = ("weight", "bias")


@dataclass(frozen=True)
class HeadUpdate:
    n: int                  # local samples the head was trained on
    weight: np.ndarray      # (C, d) float32
    bias: np.ndarray        # (C,) float32

    def tensors(self) -> dict[str, np.ndarray]:
        return {"weight": self.weight, "bias": self.bias}


def head_tensors(weight: np.ndarray, bias: np.ndarray) -> dict[str, np.ndarray]:
    """The two head tensors in wire form (float32, C order), after a shape check."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    bias = np.ascontiguousarray(bias, dtype=np.float32)
    if weight.ndim != 2 or bias.shape != (weight.shape[0],):
        raise ValueError(f"head must be weight (C, d) and bias (C,), got {weight.shape} and {bias.shape}")
    return {"weight": weight, "bias": bias}


def encode_head_update(weight: np.ndarray, bias: np.ndarray, n: int) -> tuple[dict, dict[str, np.ndarray]]:
    """(body, tensors) of a ``fedavg.head`` result."""
    tensors = head_tensors(weight, bias)
    if not all(np.isfinite(t).all() for t in tensors.values()):
        raise ValueError("the trained head contains NaN or Inf (diverged local training?)")
    if int(n) < 1:
        raise ValueError(f"sample count must be >= 1, got {n}")
    C, d = tensors["weight"].shape
    return {"n": int(n), "num_classes": int(C), "feature_dim": int(d)}, tensors


def parse_head_update(msg: Envelope, num_classes: int, feature_dim: int,
                      max_samples: int = 10**9) -> HeadUpdate:
    """Validate a ``fedavg.head`` result against the job's (C, d); raise EnvelopeError if anything is off."""
    n = body_field(msg, "n", int)
    if not (0 < n <= max_samples):
        raise EnvelopeError(f"{KIND}: sample count n={n} out of range (1..{max_samples})")
    if body_field(msg, "num_classes", int) != num_classes:
        raise EnvelopeError(f"{KIND}: num_classes {msg.body['num_classes']} != job's {num_classes}")
    if body_field(msg, "feature_dim", int) != feature_dim:
        raise EnvelopeError(f"{KIND}: feature_dim {msg.body['feature_dim']} != job's {feature_dim}")
    extra = set(msg.tensors) - set(HEAD_TENSORS)
    if extra:
        raise EnvelopeError(f"{KIND}: unexpected tensors {sorted(extra)}")
    weight = require_tensor(msg, "weight", "float32", (num_classes, feature_dim))
    bias = require_tensor(msg, "bias", "float32", (num_classes,))
    require_finite(msg, *HEAD_TENSORS)
    return HeadUpdate(n=n, weight=np.asarray(weight), bias=np.asarray(bias))
