"""Payload of ``fed3r.stats`` results: a device's ridge-regression sufficient statistics.

With Z the device's (n_k x p) feature matrix (p = feature dim, +1 when the bias column of ones is
appended) and Y its one-hot labels, a device sends

* ``A_upper``  float64/float32 (p(p+1)/2,)  the upper triangle of A_k = ZᵀZ, row-major
               (numpy ``triu_indices(p)`` order: (0,0),(0,1),...,(0,p-1),(1,1),...)
* ``class_ids`` int64 (m,)   sparse form: the m classes present locally, strictly increasing
* ``b``        float (m, p)  row j = sum of the feature vectors of class class_ids[j]
               dense form: ``class_ids`` is absent and ``b`` is (C, p) (needed under secure
               aggregation, which requires fixed shapes)

and in the body ``n`` (samples), ``p``, ``num_classes``, ``format`` ("sparse"/"dense").
Sending the upper triangle halves the upload; the sparse b saves (C - m)·p values (Fed3R, [P] §III).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..envelope import Envelope, EnvelopeError, body_field, require_finite, require_tensor

KIND = "fed3r.stats"
STATS_DTYPES = ("float64", "float32")


def triu_pack(a: np.ndarray) -> np.ndarray:
    p = a.shape[0]
    return a[np.triu_indices(p)]


def triu_unpack(v: np.ndarray, p: int, out: np.ndarray | None = None) -> np.ndarray:
    """Symmetric (p x p) float64 matrix from its packed upper triangle (added into ``out`` if given)."""
    if v.shape != (p * (p + 1) // 2,):
        raise ValueError(f"packed triangle has {v.shape} values, expected {(p * (p + 1) // 2,)} for p={p}")
    full = np.zeros((p, p), dtype=np.float64)
    iu = np.triu_indices(p)
    full[iu] = v
    full = full + np.triu(full, 1).T
    if out is not None:
        out += full
        return out
    return full


def packed_len(p: int) -> int:
    return p * (p + 1) // 2


@dataclass(frozen=True)
class Fed3RStats:
    n: int
    p: int
    a_upper: np.ndarray          # (p(p+1)/2,)
    class_ids: np.ndarray        # (m,) int64
    b: np.ndarray                # (m, p)


def encode_stats(a_full: np.ndarray, class_ids: np.ndarray, b_rows: np.ndarray, n: int, num_classes: int,
                 dense: bool = False, dtype: str = "float64") -> tuple[dict, dict[str, np.ndarray]]:
    if dtype not in STATS_DTYPES:
        raise ValueError(f"stats dtype must be one of {STATS_DTYPES}")
    p = a_full.shape[0]
    body = {"n": int(n), "p": int(p), "num_classes": int(num_classes), "format": "dense" if dense else "sparse"}
    if dense:
        full_b = np.zeros((num_classes, p), dtype=np.float64)
        full_b[class_ids] = b_rows
        tensors = {"A_upper": triu_pack(a_full).astype(dtype), "b": full_b.astype(dtype)}
    else:
        tensors = {"A_upper": triu_pack(a_full).astype(dtype),
                   "class_ids": np.asarray(class_ids, dtype=np.int64), "b": np.asarray(b_rows).astype(dtype)}
    return body, tensors


def parse_stats(msg: Envelope, p: int, num_classes: int, max_samples: int = 10**9) -> Fed3RStats:
    """Validate a ``fed3r.stats`` result against the job's (p, C); raise EnvelopeError if anything is off."""
    n = body_field(msg, "n", int)
    if not (0 < n <= max_samples):
        raise EnvelopeError(f"{KIND}: sample count n={n} out of range (1..{max_samples})")
    if body_field(msg, "p", int) != p:
        raise EnvelopeError(f"{KIND}: feature dim {msg.body['p']} != job's {p}")
    if body_field(msg, "num_classes", int) != num_classes:
        raise EnvelopeError(f"{KIND}: num_classes {msg.body['num_classes']} != job's {num_classes}")
    fmt = body_field(msg, "format", str)
    a_dtype = msg.tensors.get("A_upper", np.empty(0)).dtype.name
    if a_dtype not in STATS_DTYPES:
        raise EnvelopeError(f"{KIND}: A_upper dtype {a_dtype} not in {STATS_DTYPES}")
    a = require_tensor(msg, "A_upper", a_dtype, (packed_len(p),))
    if fmt == "sparse":
        ids = require_tensor(msg, "class_ids", "int64", (None,))
        b = require_tensor(msg, "b", a_dtype, (len(ids), p))
        if len(ids) == 0 or (ids < 0).any() or (ids >= num_classes).any() or (np.diff(ids) <= 0).any():
            raise EnvelopeError(f"{KIND}: class_ids must be non-empty, strictly increasing, within [0, {num_classes})")
    elif fmt == "dense":
        if "class_ids" in msg.tensors:
            raise EnvelopeError(f"{KIND}: dense format carries no class_ids")
        b = require_tensor(msg, "b", a_dtype, (num_classes, p))
        ids = np.arange(num_classes, dtype=np.int64)
    else:
        raise EnvelopeError(f"{KIND}: unknown format {fmt!r}")
    require_finite(msg, "A_upper", "b")
    # Cheap sanity on A = ZᵀZ: its diagonal is a sum of squares.
    diag = a[_diag_positions(p)]
    if (diag < 0).any():
        raise EnvelopeError(f"{KIND}: A has a negative diagonal entry; not a Gram matrix")
    # Copies: the decoded tensors are read-only views on the received bytes.
    return Fed3RStats(n=n, p=p, a_upper=np.array(a, dtype=np.float64), class_ids=np.array(ids),
                      b=np.array(b, dtype=np.float64))


def _diag_positions(p: int) -> np.ndarray:
    # Row i of the packed triangle starts at i*p - i*(i-1)/2; its first entry is (i, i).
    i = np.arange(p)
    return i * p - i * (i - 1) // 2
