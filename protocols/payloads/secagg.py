"""Carrying secure-aggregation messages in fedfleet envelopes, and the Fed3R-Sync vector layout.

A SecAgg message travels as an envelope of type ``secagg``: ``body = {"secagg": header}`` (the
message's own signed JSON header) and the message's arrays as tensors. The envelope adds size
limits and integrity; authenticity comes from the SecAgg message's own Ed25519 signature.

Fed3R-Sync devices sum their statistics under secure aggregation, which needs one fixed-shape
vector per device: ``[A_upper (p(p+1)/2) | b dense (C·p, row-major, class-major) | n]``.
Secure FedAvg(ψ) devices send ``[n·weight (C·d, row-major) | n·bias (C) | n]``: the sum is
(Σ n_k W_k, Σ n_k b_k, Σ n_k), whose ratio is the FedAvg mean.
"""

from __future__ import annotations

import numpy as np

from ..envelope import Envelope, EnvelopeError
from ..secagg import Message, SecAggError, decode
from .fed3r import packed_len

SECAGG_TYPE = "secagg"
SYNC_KIND = "fed3r.secure"
SECURE_FEDAVG_KIND = "fedavg.secure"


def to_envelope(msg: Message) -> Envelope:
    header, arrays = msg.to_wire()
    return Envelope(type=SECAGG_TYPE, sender=msg.sender, body={"secagg": header}, tensors=dict(arrays))


def from_envelope(env: Envelope) -> Message:
    if env.type != SECAGG_TYPE or not isinstance(env.body.get("secagg"), dict):
        raise EnvelopeError("not a secagg envelope")
    try:
        msg = decode(env.body["secagg"], {k: np.asarray(v) for k, v in env.tensors.items()})
    except SecAggError as exc:
        raise EnvelopeError(f"malformed secagg message: {exc}") from exc
    if msg.sender != env.sender:
        raise EnvelopeError(f"secagg sender {msg.sender!r} differs from envelope sender {env.sender!r}")
    return msg


def sync_vector_length(p: int, num_classes: int) -> int:
    return packed_len(p) + num_classes * p + 1


def pack_sync_vector(a_upper: np.ndarray, b_dense: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([np.asarray(a_upper, np.float64).ravel(), np.asarray(b_dense, np.float64).ravel(),
                           np.array([float(n)])])


def unpack_sync_vector(v: np.ndarray, p: int, num_classes: int) -> tuple[np.ndarray, np.ndarray, int]:
    if v.shape != (sync_vector_length(p, num_classes),):
        raise ValueError(f"sync vector has shape {v.shape}, expected ({sync_vector_length(p, num_classes)},)")
    k = packed_len(p)
    return v[:k], v[k:k + num_classes * p].reshape(num_classes, p), int(round(v[-1]))


def weighted_head_length(num_classes: int, feature_dim: int) -> int:
    return num_classes * feature_dim + num_classes + 1


def pack_weighted_head(weight: np.ndarray, bias: np.ndarray, n: int) -> np.ndarray:
    weight, bias = np.asarray(weight, np.float64), np.asarray(bias, np.float64)
    return np.concatenate([n * weight.ravel(), n * bias.ravel(), np.array([float(n)])])


def unpack_weighted_head_sum(v: np.ndarray, num_classes: int, feature_dim: int
                             ) -> tuple[np.ndarray, np.ndarray, int]:
    """(Σ n_k W_k (C, d), Σ n_k b_k (C,), Σ n_k) from a group sum."""
    if v.shape != (weighted_head_length(num_classes, feature_dim),):
        raise ValueError(f"weighted head sum has shape {v.shape}, expected "
                         f"({weighted_head_length(num_classes, feature_dim)},)")
    k = num_classes * feature_dim
    return v[:k].reshape(num_classes, feature_dim), v[k:k + num_classes], int(round(v[-1]))
