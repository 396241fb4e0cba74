"""Carrying secure-aggregation messages in fedfleet envelopes, and the Fed3R-Sync vector layout.

A SecAgg message travels as an envelope of type ``secagg``: ``body = {"secagg": header}`` (the
message's own signed JSON header) and the message's arrays as tensors. The envelope adds size
limits and integrity; authenticity comes from the SecAgg message's own Ed25519 signature.

Fed3R-Sync devices sum their statistics under secure aggregation, which needs one fixed-shape
vector per device: ``[A_upper (p(p+1)/2) | b dense (C·p, row-major, class-major) | n]``.
Under distributed DP the count is 0 (it would be an un-noised release); with ``block_scales``
(the ``ssp`` mechanism's per-block noise) the device first multiplies A_upper's off-diagonal
entries and b by the task's scales (:func:`scale_sync_blocks`) and puts 1 in the count slot,
which the noise leaves alone: the sum's count is then how many members scaled, and an aggregator
that finds another count than the survivors (a device library that ignores ``block_scales``
leaves 0) discards the sum instead of scaling back what was never scaled. The slot guards
against old libraries, not attackers (a malicious member can fake it as it can its statistics).
Secure FedAvg(ψ) devices send ``[n·weight (C·d, row-major) | n·bias (C) | n]``: the sum is
(Σ n_k W_k, Σ n_k b_k, Σ n_k), whose ratio is the FedAvg mean.

Secure LADD devices (``ladd.train.secure``) send one vector with a *slot* per cluster, laid out
by a :class:`ClusterSlotLayout` that travels in the task params (``slots``, JSON below)::

    [ n·φ (global tensors, layout order) | slot_0 | … | slot_{C-1} | n | n·e_c (C) | e_c (C) ]

slot_c = n·θ (the cluster-specific tensors, in the slot layout's order) for the device's own
cluster c when that slot is *enabled* this round, zeros otherwise; e_c is the one-hot vector
of c, and it is zeros too when slot c is disabled (a disabled cluster reveals nothing of its
own, its devices only add to φ). Each tensor is flattened C-order. The group sum therefore
holds Σ n_k φ_k and Σ n_k over every survivor, and for every enabled cluster Σ n_k θ_k,
Σ n_k and the number of contributors: exactly what LADD's cluster-specific averaging needs.

``slots`` JSON: ``{"global": [[name, shape], …], "slot": [[name, shape], …], "enabled":
[bool × C]}``; names are unique across both lists. Its digest is the sha256 of its canonical
JSON (sorted keys, no spaces), and the secure round's ``group_id`` is ``"ladd-slots-" +
digest``: the group id is inside the aggregator's signed ``RoundConfig``, so a device whose
vector follows another layout than the one the round was configured with cannot take part.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..envelope import MAX_HEADER_BYTES, MAX_MESSAGE_BYTES, Envelope, EnvelopeError, canonical_json
from ..secagg import Message, SecAggError, decode
from .fed3r import packed_diagonal, packed_len
from .ladd import Layout, layout_from_json, layout_size, layout_to_json

SECAGG_TYPE = "secagg"
SYNC_KIND = "fed3r.secure"
SECURE_TAIL_KIND = "fedavg.tail.secure"     # FT(φ)/FT(M) tail updates, summed
SECURE_FEDAVG_KIND = "fedavg.secure"
SECURE_LADD_KIND = "ladd.train.secure"
SECURE_PP_KIND = "pp.head.secure"           # partial personalization: the shared weight's updates, summed
SECURE_SCAFFOLD_KIND = "scaffold.head.secure"   # Scaffold(ψ): the head's updates and the devices' Δc, summed
SECURE_DITTO_KIND = "ditto.head.secure"     # Ditto(ψ): the global head's updates, summed
MAX_SLOT_CLUSTERS = 64
MAX_SLOT_VECTOR = 2 ** 27          # RoundConfig's largest vector_length


# What encode() adds to the header beyond the envelope's fields and body: the payload's sha256
# and a signature (under 300 bytes), and a descriptor per tensor (name, dtype, shape, offset,
# nbytes: under 160 bytes plus the name). Rounded up: a message this close to the limit is refused.
_HEADER_OVERHEAD_BYTES = 512
_TENSOR_DESCRIPTOR_BYTES = 192


class UnsendableMessage(EnvelopeError):
    """A secagg message too large for one envelope (header or whole): it cannot be sent, so the
    round it belongs to cannot go on. The sender fails the round (aggregator) or sits it out
    (device) with this reason, once."""


def to_envelope(msg: Message) -> Envelope:
    """The message as an envelope, checked against the envelope's size limits before anything is
    published (raise :class:`UnsendableMessage`): a SecAgg message's header grows with its key
    directory and id lists, and one that only fails inside the transport would fail there once
    per message, with nothing telling the round why."""
    header, arrays = msg.to_wire()
    env = Envelope(type=SECAGG_TYPE, sender=msg.sender, body={"secagg": header}, tensors=dict(arrays))
    header_bytes = (len(canonical_json(env.header_fields())) + _HEADER_OVERHEAD_BYTES
                    + sum(_TENSOR_DESCRIPTOR_BYTES + len(name) for name in arrays))
    if header_bytes > MAX_HEADER_BYTES:
        raise UnsendableMessage(f"{msg.TYPE} to {msg.recipient}: its header needs about {header_bytes} bytes, over "
                                f"the envelope's {MAX_HEADER_BYTES}-byte limit")
    total = header_bytes + sum(a.nbytes for a in arrays.values())
    if total > MAX_MESSAGE_BYTES:
        raise UnsendableMessage(f"{msg.TYPE} to {msg.recipient}: {total} bytes, over the envelope's "
                                f"{MAX_MESSAGE_BYTES}-byte limit")
    return env


def from_envelope(env: Envelope) -> Message:
    if env.type != SECAGG_TYPE or not isinstance(env.body.get("secagg"), dict):
        raise EnvelopeError("not a secagg envelope")
    try:
        msg = decode(env.body["secagg"], {k: np.asarray(v) for k, v in env.tensors.items()})
    except SecAggError as exc:
        raise EnvelopeError(f"malformed secagg message: {exc}") from exc
    if msg.sender != env.sender:
        raise EnvelopeError(f"secagg sender {msg.sender!r} differs from envelope sender {env.sender!r}")
    if env.verified_payload is not None and len(env.tensors) == 1:
        # a message with one array that is the whole payload decode() hashed (a masked input): the
        # signature check need not hash it again. Kept only if the array still is that memory.
        payload, sha256_hex = env.verified_payload
        msg.with_verified_digest(next(iter(env.tensors)), np.frombuffer(payload, np.uint8), sha256_hex)
    return msg


def sync_vector_length(p: int, num_classes: int) -> int:
    return packed_len(p) + num_classes * p + 1


def pack_sync_vector(a_upper: np.ndarray, b_dense: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([np.asarray(a_upper, np.float64).ravel(), np.asarray(b_dense, np.float64).ravel(),
                           np.array([float(n)])])


def scale_sync_blocks(v: np.ndarray, p: int, num_classes: int, a_off_diagonal: float, b: float) -> np.ndarray:
    """A copy of the sync vector ``v`` with its packed A's off-diagonal entries times
    ``a_off_diagonal`` and its B times ``b``; A's diagonal and the count stay. A distributed-DP
    device scales its vector so (``block_scales`` of its task, :class:`~protocols.payloads.
    secure_tasks.SyncBlockScales`) before adding one Skellam stddev to every entry, and the
    aggregator scales the sum back with the reciprocals: per-block noise from one stddev."""
    out = np.array(v, dtype=np.float64)
    if out.shape != (sync_vector_length(p, num_classes),):
        raise ValueError(f"sync vector has shape {out.shape}, expected ({sync_vector_length(p, num_classes)},)")
    k, diagonal = packed_len(p), packed_diagonal(p)
    kept = out[diagonal]
    out[:k] *= a_off_diagonal
    out[diagonal] = kept
    out[k:k + num_classes * p] *= b
    return out


def sync_center_vector(a_upper: np.ndarray, p: int) -> np.ndarray:
    """A ``center_round`` device's vector: A's intercept (last) column, (Σ z_i, n), read from the
    packed upper triangle (row i's last entry is A[i, p-1]). p values."""
    a_upper = np.asarray(a_upper, dtype=np.float64)
    if a_upper.shape != (packed_len(p),):
        raise ValueError(f"packed A has shape {a_upper.shape}, expected ({packed_len(p)},)")
    return a_upper[np.cumsum(np.arange(p, 0, -1)) - 1].copy()


def unpack_sync_vector(v: np.ndarray, p: int, num_classes: int) -> tuple[np.ndarray, np.ndarray, int]:
    if v.shape != (sync_vector_length(p, num_classes),):
        raise ValueError(f"sync vector has shape {v.shape}, expected ({sync_vector_length(p, num_classes)},)")
    k = packed_len(p)
    return v[:k], v[k:k + num_classes * p].reshape(num_classes, p), int(round(v[-1]))


# Secure FedAvg-family rounds: a device contributes [n·t_1 | … | n·t_k | n] for the tensors it
# trained, in the order the task names (``vector_order``; the head's is weight, bias). The group
# sum gives Σ n_k t_k per tensor and Σ n_k, hence the FedAvg mean, without any t_k being seen.
HEAD_ORDER = ("weight", "bias")


def weighted_length(shapes: Mapping[str, tuple[int, ...]]) -> int:
    return sum(int(np.prod(shape)) for shape in shapes.values()) + 1


def pack_weighted(tensors: Mapping[str, np.ndarray], order: Sequence[str], n: int) -> np.ndarray:
    if set(order) != set(tensors) or len(order) != len(tensors):
        raise ValueError(f"vector order {list(order)} does not name exactly the tensors {sorted(tensors)}")
    return np.concatenate([n * np.asarray(tensors[name], np.float64).ravel() for name in order]
                          + [np.array([float(n)])])


def unpack_weighted_sum(v: np.ndarray, shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, np.ndarray], int]:
    """({name: Σ n_k t_k}, Σ n_k) from a group sum laid out in ``shapes``' order."""
    if v.shape != (weighted_length(shapes),):
        raise ValueError(f"weighted sum has shape {v.shape}, expected ({weighted_length(shapes)},)")
    out, start = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        out[name] = v[start:start + size].reshape(shape)
        start += size
    return out, int(round(v[-1]))


# Secure Scaffold rounds: a device contributes [n·y_1 | … | n·y_m | Δc_1 | … | Δc_m | n], y the
# tensors it trained and Δc their control deltas (clipped to the job's control_clip_norm), both
# in the task's ``vector_order``. Δc is unweighted: Scaffold's c moves by the plain mean of the
# devices' Δc, so the group sum gives Σ n_k y_k, Σ Δc_k and Σ n_k (the count of devices is the
# number of survivors the protocol reports).
def controlled_length(shapes: Mapping[str, tuple[int, ...]]) -> int:
    return 2 * weighted_length(shapes) - 1


def pack_controlled(trained: Mapping[str, np.ndarray], deltas: Mapping[str, np.ndarray], order: Sequence[str],
                    n: int) -> np.ndarray:
    weighted = pack_weighted(trained, order, n)
    unweighted = pack_weighted(deltas, order, 1)
    return np.concatenate([weighted[:-1], unweighted[:-1], weighted[-1:]])


def unpack_controlled_sum(v: np.ndarray, shapes: Mapping[str, tuple[int, ...]]
                          ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """({name: Σ n_k y_k}, {name: Σ Δc_k}, Σ n_k) from a group sum laid out in ``shapes``' order."""
    if v.shape != (controlled_length(shapes),):
        raise ValueError(f"controlled sum has shape {v.shape}, expected ({controlled_length(shapes)},)")
    size = weighted_length(shapes) - 1
    sums, n = unpack_weighted_sum(np.concatenate([v[:size], v[-1:]]), shapes)
    deltas, _ = unpack_weighted_sum(v[size:], shapes)
    return sums, deltas, n


def weighted_head_length(num_classes: int, feature_dim: int) -> int:
    return weighted_length({"weight": (num_classes, feature_dim), "bias": (num_classes,)})


def pack_weighted_head(weight: np.ndarray, bias: np.ndarray, n: int) -> np.ndarray:
    return pack_weighted({"weight": weight, "bias": bias}, HEAD_ORDER, n)


def unpack_weighted_head_sum(v: np.ndarray, num_classes: int, feature_dim: int
                             ) -> tuple[np.ndarray, np.ndarray, int]:
    """(Σ n_k W_k (C, d), Σ n_k b_k (C,), Σ n_k) from a group sum."""
    sums, n = unpack_weighted_sum(v, {"weight": (num_classes, feature_dim), "bias": (num_classes,)})
    return sums["weight"], sums["bias"], n


# ----------------------------------------------------------------------------- secure LADD
def _layout_or_empty(value: Any, what: str) -> Layout:
    if value == []:
        return []
    try:
        return layout_from_json(value)
    except ValueError as exc:
        raise ValueError(f"slots: bad {what} layout: {exc}") from exc


@dataclass(frozen=True)
class SlotSums:
    """A secure LADD group sum, decoded: Σ n·φ, Σ n·θ per enabled cluster, Σ n, and per cluster
    Σ n and the number of contributors (both 0 for disabled clusters)."""

    phi: dict[str, np.ndarray]
    theta: dict[int, dict[str, np.ndarray]]
    n: int
    n_per_cluster: np.ndarray        # int64 (C,)
    count_per_cluster: np.ndarray    # int64 (C,)


def slot_vector_length(global_size: int, slot_size: int, n_clusters: int) -> int:
    """The entries of a secure LADD vector of ``n_clusters`` slots (:class:`ClusterSlotLayout`'s
    form): the global tensors, a slot per cluster, n, and a weight and a count per cluster. A job
    sizes its largest round with it before any layout exists (``aggregator/jobs/secure_ladd.py``)."""
    return global_size + n_clusters * slot_size + 1 + 2 * n_clusters


@dataclass(frozen=True)
class ClusterSlotLayout:
    """The layout of a secure LADD device's vector (module doc): global tensors, one slot per
    cluster (all with the slot layout), and which slots are enabled this round."""

    global_layout: Layout
    slot_layout: Layout
    enabled: tuple[bool, ...]

    def __post_init__(self):
        object.__setattr__(self, "global_layout", [(str(n), tuple(s)) for n, s in self.global_layout])
        object.__setattr__(self, "slot_layout", [(str(n), tuple(s)) for n, s in self.slot_layout])
        object.__setattr__(self, "enabled", tuple(self.enabled))
        if not all(isinstance(e, (bool, np.bool_)) for e in self.enabled):
            raise ValueError("slots: enabled must be booleans")
        if not 1 <= len(self.enabled) <= MAX_SLOT_CLUSTERS:
            raise ValueError(f"slots: 1 to {MAX_SLOT_CLUSTERS} clusters, got {len(self.enabled)}")
        names = [n for n, _ in self.global_layout] + [n for n, _ in self.slot_layout]
        if len(set(names)) != len(names):
            raise ValueError("slots: a tensor name appears twice (global and slot names must be disjoint)")
        if not names:
            raise ValueError("slots: no tensors")
        if self.vector_length > MAX_SLOT_VECTOR:
            raise ValueError(f"slots: vector of {self.vector_length} values, more than {MAX_SLOT_VECTOR}")

    # sizes
    @property
    def n_clusters(self) -> int:
        return len(self.enabled)

    @property
    def global_size(self) -> int:
        return layout_size(self.global_layout)

    @property
    def slot_size(self) -> int:
        return layout_size(self.slot_layout)

    @property
    def tensors_size(self) -> int:
        """The entries holding tensors (global and slots), before n and the cluster weights/counts."""
        return self.global_size + self.n_clusters * self.slot_size

    @property
    def vector_length(self) -> int:
        return slot_vector_length(self.global_size, self.slot_size, self.n_clusters)

    def _slot_start(self, cluster: int) -> int:
        return self.global_size + cluster * self.slot_size

    # wire form
    def to_json(self) -> dict:
        return {"global": layout_to_json(self.global_layout), "slot": layout_to_json(self.slot_layout),
                "enabled": [bool(e) for e in self.enabled]}

    @classmethod
    def from_json(cls, value: Any) -> "ClusterSlotLayout":
        """Parse task params' ``slots``; ValueError if malformed."""
        if not isinstance(value, dict) or set(value) != {"global", "slot", "enabled"}:
            raise ValueError("slots must be an object with exactly 'global', 'slot' and 'enabled'")
        enabled = value["enabled"]
        if not isinstance(enabled, list) or not all(isinstance(e, bool) for e in enabled):
            raise ValueError("slots: enabled must be a list of booleans")
        return cls(_layout_or_empty(value["global"], "global"), _layout_or_empty(value["slot"], "slot"),
                   tuple(enabled))

    def digest(self) -> str:
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def group_id(self) -> str:
        """The secure round's group id: binds this layout to the signed round configuration."""
        return "ladd-slots-" + self.digest()

    # device side
    def pack(self, tensors: Mapping[str, np.ndarray], n: int, cluster: int) -> np.ndarray:
        """The device's float64 vector from its trained tensors (every global and slot name)."""
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        if isinstance(cluster, bool) or int(cluster) != cluster or not 0 <= cluster < self.n_clusters:
            raise ValueError(f"cluster {cluster!r} is not one of the {self.n_clusters} slots")
        expected = {name for name, _ in self.global_layout} | {name for name, _ in self.slot_layout}
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            raise ValueError(f"tensors do not match the slot layout (missing {missing[:3]}, extra {extra[:3]})")
        v = np.zeros(self.vector_length, np.float64)
        segments = [(0, self.global_layout)]
        if self.enabled[cluster]:
            segments.append((self._slot_start(cluster), self.slot_layout))
        for start, layout in segments:
            for name, shape in layout:
                a = np.asarray(tensors[name], dtype=np.float64)
                if a.shape != shape:
                    raise ValueError(f"tensor {name!r} has shape {a.shape}, the slot layout says {shape}")
                if not np.isfinite(a).all():
                    raise ValueError(f"tensor {name!r} contains NaN or Inf")
                size = math.prod(shape)
                v[start:start + size] = n * a.ravel()
                start += size
        tail = self._slot_start(self.n_clusters)
        v[tail] = n
        if self.enabled[cluster]:
            v[tail + 1 + cluster] = n
            v[tail + 1 + self.n_clusters + cluster] = 1.0
        return v

    # server side
    def unpack_sum(self, total: np.ndarray) -> SlotSums:
        total = np.asarray(total, dtype=np.float64)
        if total.shape != (self.vector_length,):
            raise ValueError(f"slot sum has shape {total.shape}, expected ({self.vector_length},)")
        if not np.isfinite(total).all():
            raise ValueError("slot sum contains NaN or Inf")

        def split(flat: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
            out, offset = {}, 0
            for name, shape in layout:
                size = math.prod(shape)
                out[name] = flat[offset:offset + size].reshape(shape).copy()
                offset += size
            return out

        C, tail = self.n_clusters, self._slot_start(self.n_clusters)
        phi = split(total[:self.global_size], self.global_layout)
        theta = {c: split(total[self._slot_start(c):self._slot_start(c) + self.slot_size], self.slot_layout)
                 for c in range(C) if self.enabled[c]}
        return SlotSums(phi, theta, int(round(total[tail])), np.rint(total[tail + 1:tail + 1 + C]).astype(np.int64),
                        np.rint(total[tail + 1 + C:tail + 1 + 2 * C]).astype(np.int64))


def ladd_slot_bound(max_samples: int, max_abs_param: float) -> float:
    """B for a secure LADD round: |n·w| <= max_samples·max_abs_param, and n itself <= max_samples."""
    return float(max_samples) * max(float(max_abs_param), 1.0)
