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

Exact factor form (body ``"a_format": "factor"``, sparse b only): a device with few samples sends
instead of ``A_upper`` and ``b``

* ``zero_columns`` int64 (z,)  optional: the columns of Z that are zero in every local row (the
                   zero rows and columns of A_k), strictly increasing, within [0, p); absent when
                   there are none (never empty). K = the other q = p - z columns, in order.
* ``R``    (r, q)  the canonical factor of A_k[K, K]: RᵀR = A_k[K, K], R in row echelon form
                   (each row's first non-zero entry, its pivot, lies strictly right of the row
                   above's), every pivot positive, no zero row and no zero column; r = rank A_k ≤ n
* ``QtY``  (r, m)  Qᵀ Y restricted to the present classes (Z[:, K] = Q R): b_k[:, K] = (Rᵀ QtY)ᵀ
                   exactly, b_k zero in the zero columns

R is a function of A_k alone: its pivots are the columns at which the rank of A_k[K, K]'s leading
blocks grows, its pivot columns form the Cholesky factor of A_k's pivot block and the rest follow
(``docs/algorithms.md``); QtY is then determined by (R, b_k). So the factor reveals nothing the
dense statistics do not, exists for every device, and any R that passes ``check_canonical_factor``
is the only factor of its own RᵀR the check accepts. It costs r·q + r·m + z values against
p(p+1)/2 + m·p: at d = 1280 and r ≤ 64 about 1/10 of the paper's fp32 statistics. Absent
``a_format`` means ``"packed"`` (the triangle above).

Before anything is stored, the statistics must be what they claim (``parse_stats``): exactly the
declared tensors, finite, A symmetric positive semi-definite within the float32 wire precision
(D^-½AD^-½ + τI has a Cholesky factor, D = diag A, τ = 4·p·ε(float32); ``check_gram``), and consistent with n
(with a bias column, A's last diagonal entry is n and the bias column of b holds class counts
summing to n).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from ..envelope import Envelope, EnvelopeError, body_field, require_finite, require_tensor
from .task_params import (ModelSpec, TaskParams, WireParams, check_bool, check_choices, check_int, check_number, choice,
                          nested, optional, part)

KIND = "fed3r.stats"
STATS_DTYPES = ("float64", "float32")
B_FORMATS = ("sparse", "dense")
MAX_RANDOM_FEATURES = 100_000
CENTER_TENSOR = "feature_center"      # a centered task's tensor: the vector every feature row is shifted by


@dataclass(frozen=True)
class RandomFeaturesSpec(WireParams):
    """Random Fourier features the device maps its features through (``protocols.random_features``)."""

    dim: int
    sigma: float
    seed: int

    def __post_init__(self):
        check_int("random_features.dim", self.dim, 1, MAX_RANDOM_FEATURES)
        check_number("random_features.sigma", self.sigma, low_open=True)
        check_int("random_features.seed", self.seed, 0, 2**63 - 1)


@dataclass(frozen=True)
class Fed3RStatsParams(TaskParams):
    """``fed3r.stats`` params. ``format``: the b form; ``dtype``: the statistics' wire dtype;
    ``factor``: the device may send the exact factor form when it is smaller (sparse only);
    ``feature_clip_norm`` > 0: each feature row clipped to it (DP's and Fed3R-Sync's bound);
    ``cap_samples``: the device's statistics hold at most ``max_samples`` samples: its first ones,
    or with ``cap_by_weight`` all its n samples, each weighed min(1, ``max_samples``/n) (A and b
    are the weighted sums, ``n`` in the reply min(n, ``max_samples``)), which bounds them exactly as
    the first ones do and keeps every sample's information (``docs/algorithms.md``, DP Fed3R);
    ``from_sample`` (streaming): the samples the aggregator already holds of this device;
    ``centered``: the task carries the tensor ``feature_center`` (the feature dimension's float64
    vector, DP Fed3R's privately released mean) and the device subtracts it from every feature row
    before clipping, so the clip bound is spent on what tells the classes apart rather than on the
    mean all rows share (``docs/algorithms.md``, DP Fed3R)."""

    KIND = KIND
    model: ModelSpec = part(ModelSpec)
    fit_intercept: bool = True
    random_features: RandomFeaturesSpec | None = nested(RandomFeaturesSpec, omit_none=False)     # null: none
    format: str = choice("sparse", B_FORMATS)
    dtype: str = choice("float64", STATS_DTYPES)
    factor: bool = False
    feature_clip_norm: float | None = optional()
    max_samples: int | None = optional()
    cap_samples: bool | None = optional()
    cap_by_weight: bool | None = optional()
    from_sample: int | None = optional()
    centered: bool | None = optional()

    def __post_init__(self):
        for name in ("fit_intercept", "factor"):
            check_bool(name, getattr(self, name))
        check_choices(self)
        if self.feature_clip_norm is not None:
            check_number("feature_clip_norm", self.feature_clip_norm)
        if self.max_samples is not None:
            check_int("max_samples", self.max_samples, 1)
        if self.cap_samples is not None:
            check_bool("cap_samples", self.cap_samples)
            if self.cap_samples and self.max_samples is None:
                raise ValueError("cap_samples needs max_samples")
        if self.cap_by_weight is not None:
            check_bool("cap_by_weight", self.cap_by_weight)
            if self.cap_by_weight and not self.cap_samples:
                raise ValueError("cap_by_weight needs cap_samples")
        if self.from_sample is not None:
            check_int("from_sample", self.from_sample)
        if self.centered is not None:
            check_bool("centered", self.centered)
            if self.centered and (not self.feature_clip_norm or self.random_features is not None):
                raise ValueError("centered needs feature_clip_norm and no random_features (the center is "
                                 "subtracted from the backbone's features before the clip)")

    @property
    def sample_cap(self) -> int | None:
        return self.max_samples if self.cap_samples else None

    @property
    def weighs_samples(self) -> bool:
        """Whether the cap weighs every sample (``cap_by_weight``) rather than keeping the first ones."""
        return bool(self.cap_samples and self.cap_by_weight)


def triu_pack(a: np.ndarray) -> np.ndarray:
    """The upper triangle row by row (``a[np.triu_indices(p)]``), copied one row's slice at a time:
    8x faster than the fancy index at p = 1,281 (no index arrays, contiguous copies), which every
    Fed3R-Sync device pays once per task (bench/fleet_secure.py)."""
    p = a.shape[0]
    out = np.empty(p * (p + 1) // 2, dtype=a.dtype)
    start = 0
    for i in range(p):
        out[start:start + p - i] = a[i, i:]
        start += p - i
    return out


@lru_cache(maxsize=8)
def _triu(p: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(p)


@lru_cache(maxsize=8)
def _row_starts(p: int) -> tuple[int, ...]:
    return tuple(np.concatenate([[0], np.cumsum(np.arange(p, 0, -1))]).tolist())


def triu_fill(v: np.ndarray, p: int, out: np.ndarray | None = None) -> np.ndarray:
    """The (p x p) float64 matrix whose upper triangle is the packed ``v`` (zeros below): one
    contiguous copy per row, several times faster than a fancy-indexed scatter; what a Cholesky
    that reads only the upper triangle needs. With ``out`` (p x p, any float dtype: cast on the
    copy) only its upper triangle is written, and it is returned."""
    if v.shape != (p * (p + 1) // 2,):
        raise ValueError(f"packed triangle has {v.shape} values, expected {(p * (p + 1) // 2,)} for p={p}")
    full = np.zeros((p, p), dtype=np.float64) if out is None else out
    starts = _row_starts(p)
    for i in range(p):
        full[i, i:] = v[starts[i]:starts[i + 1]]
    return full


def triu_unpack(v: np.ndarray, p: int, out: np.ndarray | None = None) -> np.ndarray:
    """Symmetric (p x p) float64 matrix from its packed upper triangle (added into ``out`` if given)."""
    full = triu_fill(v, p)
    full += np.triu(full, 1).T
    if out is not None:
        out += full
        return out
    return full


def packed_len(p: int) -> int:
    return p * (p + 1) // 2


def packed_diagonal(p: int) -> np.ndarray:
    """The packed (row-major upper-triangle) indices of A_00, A_11, …, A_(p-1)(p-1)."""
    return np.cumsum(np.r_[0, np.arange(p, 1, -1)]).astype(np.int64)


@dataclass(frozen=True)
class Fed3RStats:
    n: int
    p: int
    a_upper: np.ndarray | None   # (p(p+1)/2,), or None for the factor form
    class_ids: np.ndarray        # (m,) int64
    b: np.ndarray | None         # (m, p), or None for the factor form
    r_factor: np.ndarray | None = None    # (r, q): A[K, K] = RᵀR, K = factor_columns
    qty: np.ndarray | None = None         # (r, m): b[:, K] = (Rᵀ QtY)ᵀ
    factor_columns: np.ndarray | None = None   # (q,) int64 K: the columns R covers; A and b are zero elsewhere

    @property
    def values(self) -> int:
        """How many numbers the device sent (the upload's size, whatever the dtype)."""
        if self.r_factor is None:
            return int(self.a_upper.size + self.b.size)
        return int(self.r_factor.size + self.qty.size + self.p - len(self.factor_columns))

    def full_factor(self) -> np.ndarray:
        """The factor as an (r, p) matrix, zeros in the zero columns: A = RᵀR, b = (Rᵀ QtY)ᵀ."""
        full = np.zeros((len(self.r_factor), self.p))
        full[:, self.factor_columns] = self.r_factor
        return full


def factor_values(r: int, p: int, m: int, zero_columns: int = 0) -> int:
    """Numbers in a factor upload: R (r × (p - z)), QtY (r × m) and the z zero-column indices."""
    return r * (p - zero_columns) + r * m + zero_columns


def dense_values(p: int, m: int) -> int:
    return packed_len(p) + m * p


def positive_zeros(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` in the wire ``dtype`` with every -0.0 written as +0.0 (x + 0.0 is x for every other
    x): the statistics are canonical payloads, so equal values must be equal bytes and equal
    payload hashes on every device (a pivot's sign flip leaves -0.0 where Java's device, like
    this one now, sends +0.0)."""
    return np.asarray(values).astype(dtype) + np.zeros((), dtype)


def encode_factor(r_factor: np.ndarray, qty: np.ndarray, class_ids: np.ndarray, n: int, num_classes: int,
                  dtype: str = "float64", zero_columns: np.ndarray | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """The factor form of a device's statistics (see the module docstring): ``r_factor`` covers the
    columns not in ``zero_columns`` (sent only when there are some)."""
    if dtype not in STATS_DTYPES:
        raise ValueError(f"stats dtype must be one of {STATS_DTYPES}")
    zero = np.asarray(zero_columns if zero_columns is not None else [], dtype=np.int64)
    body = {"n": int(n), "p": int(r_factor.shape[1] + len(zero)), "num_classes": int(num_classes),
            "format": "sparse", "a_format": "factor"}
    tensors = {"R": positive_zeros(r_factor, dtype), "QtY": positive_zeros(qty, dtype),
               "class_ids": np.asarray(class_ids, dtype=np.int64)}
    if len(zero):
        tensors["zero_columns"] = zero
    return body, tensors


def encode_stats(a_full: np.ndarray, class_ids: np.ndarray, b_rows: np.ndarray, n: int, num_classes: int,
                 dense: bool = False, dtype: str = "float64") -> tuple[dict, dict[str, np.ndarray]]:
    if dtype not in STATS_DTYPES:
        raise ValueError(f"stats dtype must be one of {STATS_DTYPES}")
    p = a_full.shape[0]
    body = {"n": int(n), "p": int(p), "num_classes": int(num_classes), "format": "dense" if dense else "sparse"}
    if dense:
        full_b = np.zeros((num_classes, p), dtype=np.float64)
        full_b[class_ids] = b_rows
        tensors = {"A_upper": positive_zeros(triu_pack(a_full), dtype), "b": positive_zeros(full_b, dtype)}
    else:
        tensors = {"A_upper": positive_zeros(triu_pack(a_full), dtype),
                   "class_ids": np.asarray(class_ids, dtype=np.int64), "b": positive_zeros(b_rows, dtype)}
    return body, tensors


# (U, τ) -> whether U + τI has a Cholesky factor, computed in U's dtype (float32 or float64), U
# holding a symmetric matrix in its upper triangle only (zeros below; ``triu_fill``); the
# aggregator injects its own (torch, on the GPU when there is one) so that protocols stays free of
# torch; the default is LAPACK's through numpy.
PositiveDefinite = Callable[[np.ndarray, float], bool]


def numpy_positive_definite(upper: np.ndarray, tau: float) -> bool:
    shifted = upper.T + tau * np.eye(len(upper), dtype=upper.dtype)   # lower-filled: numpy's Cholesky reads only that triangle
    try:
        np.linalg.cholesky(shifted)
        return True
    except np.linalg.LinAlgError:
        return False


def parse_stats(msg: Envelope, p: int, num_classes: int, max_samples: int = 10**9,
                fit_intercept: bool = True,
                positive_definite: PositiveDefinite = numpy_positive_definite, checked: bool = False,
                weighed: bool = False) -> Fed3RStats:
    """Validate a ``fed3r.stats`` result against the job's (p, C); raise EnvelopeError if anything is
    off (shapes, dtypes, finiteness, a Gram matrix's properties, consistency with n).
    ``checked``: these very bytes passed this function before (in an ingest worker, or before they
    were stored): the passes over every value (finiteness, the Gram check) are skipped, and float64
    tensors come back as the read-only views on ``msg``'s bytes they are, not copies.
    ``weighed``: the task capped samples by weight (``cap_by_weight``), so the class counts in the
    bias column are weighted counts, not whole numbers (they still sum to n)."""
    n = body_field(msg, "n", int)
    if not (0 < n <= max_samples):
        raise EnvelopeError(f"{KIND}: sample count n={n} out of range (1..{max_samples})")
    if body_field(msg, "p", int) != p:
        raise EnvelopeError(f"{KIND}: feature dim {msg.body['p']} != job's {p}")
    if body_field(msg, "num_classes", int) != num_classes:
        raise EnvelopeError(f"{KIND}: num_classes {msg.body['num_classes']} != job's {num_classes}")
    fmt = body_field(msg, "format", str)
    a_format = msg.body.get("a_format", "packed")
    if a_format == "factor":
        stats = _parse_factor(msg, n, p, num_classes, weighed)
    elif a_format == "packed":
        stats = _parse_packed(msg, fmt, n, p, num_classes, positive_definite, checked)
    else:
        raise EnvelopeError(f"{KIND}: unknown a_format {a_format!r} (packed | factor)")
    if fit_intercept:
        _check_counts(stats, n, whole=not weighed)
    return stats


def _stats_dtype(msg: Envelope, name: str) -> str:
    dtype = msg.tensors[name].dtype.name if name in msg.tensors else "missing"
    if dtype not in STATS_DTYPES:
        raise EnvelopeError(f"{KIND}: {name} dtype {dtype} not in {STATS_DTYPES}")
    return dtype


def _exact_tensors(msg: Envelope, names: set[str]) -> None:
    if set(msg.tensors) != names:
        raise EnvelopeError(f"{KIND}: expected exactly the tensors {sorted(names)}, got {sorted(msg.tensors)}")


def _class_ids(msg: Envelope, num_classes: int) -> np.ndarray:
    ids = require_tensor(msg, "class_ids", "int64", (None,))
    if len(ids) == 0 or (ids < 0).any() or (ids >= num_classes).any() or (np.diff(ids) <= 0).any():
        raise EnvelopeError(f"{KIND}: class_ids must be non-empty, strictly increasing, within [0, {num_classes})")
    return np.array(ids)


def _parse_packed(msg: Envelope, fmt: str, n: int, p: int, num_classes: int,
                  positive_definite: PositiveDefinite, checked: bool) -> Fed3RStats:
    a_dtype = _stats_dtype(msg, "A_upper")
    a = require_tensor(msg, "A_upper", a_dtype, (packed_len(p),))
    if fmt == "sparse":
        _exact_tensors(msg, {"A_upper", "class_ids", "b"})
        ids = _class_ids(msg, num_classes)
        b = require_tensor(msg, "b", a_dtype, (len(ids), p))
    elif fmt == "dense":
        _exact_tensors(msg, {"A_upper", "b"})
        b = require_tensor(msg, "b", a_dtype, (num_classes, p))
        ids = np.arange(num_classes, dtype=np.int64)
    else:
        raise EnvelopeError(f"{KIND}: unknown format {fmt!r}")
    if checked:                             # float64 views stay views (read-only)
        return Fed3RStats(n=n, p=p, a_upper=np.asarray(a, np.float64), class_ids=ids, b=np.asarray(b, np.float64))
    require_finite(msg, "A_upper", "b")
    # float64 tensors stay read-only views on the received bytes, as when checked: a copy of a
    # 6.6 MB upload cost fresh pages the kernel zeroes, for statistics that are only read
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    check_gram(a, p, np.finfo(a_dtype).eps, positive_definite)
    return Fed3RStats(n=n, p=p, a_upper=a, class_ids=ids, b=b)


def _parse_factor(msg: Envelope, n: int, p: int, num_classes: int, weighed: bool = False) -> Fed3RStats:
    """The factor form: R has at most n rows (its rank, at most the rows summed), or, when the
    samples were weighed (more rows summed than ``n`` says), at most its columns."""
    if body_field(msg, "format", str) != "sparse":
        raise EnvelopeError(f"{KIND}: the factor form carries a sparse b (format 'sparse')")
    names = {"R", "QtY", "class_ids"}
    _exact_tensors(msg, (names | {"zero_columns"}) if "zero_columns" in msg.tensors else names)
    kept = _kept_columns(msg, p)
    dtype = _stats_dtype(msg, "R")
    r_factor = require_tensor(msg, "R", dtype, (None, len(kept)))
    most = len(kept) if weighed else n
    if not 1 <= len(r_factor) <= most:
        raise EnvelopeError(f"{KIND}: factor R has {len(r_factor)} rows; expected 1..{'its columns' if weighed else 'n'}"
                            f"={most}")
    ids = _class_ids(msg, num_classes)
    qty = require_tensor(msg, "QtY", dtype, (len(r_factor), len(ids)))
    require_finite(msg, "R", "QtY")
    check_canonical_factor(r_factor)
    return Fed3RStats(n=n, p=p, a_upper=None, class_ids=ids, b=None, r_factor=np.array(r_factor, dtype=np.float64),
                      qty=np.array(qty, dtype=np.float64), factor_columns=kept)


def _kept_columns(msg: Envelope, p: int) -> np.ndarray:
    """The columns the factor covers: all p but the ``zero_columns`` (when sent: non-empty,
    strictly increasing, within [0, p))."""
    if "zero_columns" not in msg.tensors:
        return np.arange(p, dtype=np.int64)
    zero = require_tensor(msg, "zero_columns", "int64", (None,))
    if len(zero) == 0 or len(zero) >= p or zero[0] < 0 or zero[-1] >= p or (np.diff(zero) <= 0).any():
        raise EnvelopeError(f"{KIND}: zero_columns must be non-empty (else absent), strictly increasing, "
                            f"within [0, {p}) and leave a column")
    keep = np.ones(p, dtype=bool)
    keep[zero] = False
    return np.flatnonzero(keep).astype(np.int64)


def check_canonical_factor(r_factor: np.ndarray) -> None:
    """Refuse a factor that is not the canonical one of its RᵀR (``docs/algorithms.md``): R must be
    in row echelon form with exact zeros before each row's pivot (its first non-zero entry), the
    pivots strictly increasing and positive, no zero row and no zero column (a zero column belongs
    in ``zero_columns``). Any other factor of the same A is an orthogonal transform of this one
    and fails these conditions, so an accepted factor carries nothing beyond A (and b)."""
    nonzero = r_factor != 0
    if not nonzero.any(axis=1).all():
        raise EnvelopeError(f"{KIND}: factor R has a zero row (its rows must be independent)")
    if not nonzero.any(axis=0).all():
        raise EnvelopeError(f"{KIND}: factor R has a zero column that is not listed in zero_columns")
    pivots = nonzero.argmax(axis=1)
    if (np.diff(pivots) <= 0).any():
        raise EnvelopeError(f"{KIND}: factor R is not in row echelon form (each row's first non-zero entry "
                            f"must lie right of the row above's)")
    if (r_factor[np.arange(len(r_factor)), pivots] <= 0).any():
        raise EnvelopeError(f"{KIND}: factor R has a negative pivot (each row's first non-zero entry must be positive)")
    if (np.signbit(r_factor) & ~nonzero).any():
        raise EnvelopeError(f"{KIND}: factor R holds -0.0 (a canonical payload writes every zero as +0.0)")


def check_gram(a_upper: np.ndarray, p: int, eps: float, positive_definite: PositiveDefinite = numpy_positive_definite) -> None:
    """Refuse a packed symmetric A that is not positive semi-definite within the float32 wire
    precision, the coarsest one a job accepts: with D = diag A, D^-½ A D^-½ + τI must have a
    Cholesky factor, τ = 4·p·ε(float32) (rounding each entry of a Gram matrix to float32 moves the
    eigenvalues of its unit-diagonal form by less than that). A sender could always have sent its
    matrix in float32 and been held to exactly this bound, so checking a float64 matrix more
    strictly would buy nothing against an attacker; per coordinate (D^-½ A D^-½) it is stricter than
    one shift by the largest diagonal entry. The factorisation runs in float32, the check 1.5x
    faster than the float64 one (``bench/ingest_steps.py``): it is the largest cost of ingesting a
    dense upload. An honest matrix whose
    float32 factorisation fails on rounding alone (never seen, but not excluded by the bound) gets
    the float64 check at its own wire precision (τ = 4·p·eps·max diag) before it is refused."""
    diag = a_upper[_diagonal_positions(p)]              # row i of the packed triangle starts at A_ii
    if (diag < 0).any():
        raise EnvelopeError(f"{KIND}: A has a negative diagonal entry; not a Gram matrix")
    dead = diag == 0
    if dead.any() and _dead_rows_nonzero(a_upper, p, np.flatnonzero(dead)):
        raise EnvelopeError(f"{KIND}: A has a zero diagonal entry with a non-zero row; not a Gram matrix")
    inv_sqrt = (1.0 / np.sqrt(np.where(dead, 1.0, diag))).astype(np.float32)
    unit = triu_fill(a_upper, p, out=_gram_scratch(p))    # its upper triangle, cast to float32 on the copy
    unit *= inv_sqrt[:, None]                            # scaled in place to a unit diagonal
    unit *= inv_sqrt[None, :]
    if positive_definite(unit, 4 * p * float(np.finfo(np.float32).eps)):
        return
    tau = 4 * p * eps * float(diag.max(initial=0.0)) + np.finfo(np.float64).tiny
    if not positive_definite(triu_fill(a_upper, p), tau):
        raise EnvelopeError(f"{KIND}: A is not positive semi-definite (within its wire precision); "
                            f"not a Gram matrix")


@lru_cache(maxsize=8)
def _diagonal_positions(p: int) -> np.ndarray:
    return np.asarray(_row_starts(p)[:-1], dtype=np.int64)


def _dead_rows_nonzero(a_upper: np.ndarray, p: int, dead: np.ndarray) -> bool:
    """Whether any row (equivalently column) ``d`` of the packed symmetric A holds a non-zero entry,
    for each ``d`` in ``dead``: row d's packed segment holds A_dj for j >= d, the segments of the rows
    above it A_id for i < d."""
    starts = _row_starts(p)
    for d in dead.tolist():
        above = np.asarray(starts[:d], dtype=np.int64) + (d - np.arange(d))
        if a_upper[starts[d]:starts[d + 1]].any() or a_upper[above].any():
            return True
    return False


_SCRATCH = threading.local()


def _gram_scratch(p: int) -> np.ndarray:
    """This thread's (p x p) float32 matrix for the Gram check, made once and reused. A fresh one per
    upload cost more than the factorisation on the development VM: the kernel zeroes every new page
    (``clear_page_erms`` was a quarter of the ingest bench's samples under ``perf``). Only its upper
    triangle is ever written (the fill, and LAPACK's factor in place: ``cholesky_in_place``), so
    what lies below stays the zeros it was made with, and the scaling keeps it so."""
    unit = getattr(_SCRATCH, "unit", None)
    if unit is None or unit.shape != (p, p):
        unit = _SCRATCH.unit = np.zeros((p, p), dtype=np.float32)
    return unit


def _check_counts(stats: Fed3RStats, n: int, whole: bool = True) -> None:
    """With a bias column of ones, A's last diagonal entry is n and b's bias column holds the
    per-class counts, which sum to n (checked on the rounded wire values), whole numbers unless the
    samples were weighed (``whole`` False)."""
    if stats.r_factor is not None:
        bias = stats.full_factor()[:, -1]          # zero if the bias column was listed among the zero columns
        last = float(bias @ bias)
        counts = bias @ stats.qty
    else:
        last, counts = float(stats.a_upper[-1]), stats.b[:, -1]
    tol = 1e-4 * n + 1e-6
    if abs(last - n) > tol or abs(float(counts.sum()) - n) > tol or (counts < -tol).any() \
            or (whole and (np.abs(counts - np.round(counts)) > tol).any()):
        raise EnvelopeError(f"{KIND}: the statistics do not add up to n={n} samples (bias entries)")
