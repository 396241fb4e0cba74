"""Fixed-point encoding of float64 vectors into Z_{2^64} (two's complement) and its bound.

q = rint(x * 2^f) as int64, stored as the uint64 with the same bits. Sums of such words taken
modulo 2^64 and read back as int64 equal the integer sum exactly as long as the true sum lies in
[-2^63, 2^63). With n clients each sending |x| <= B, |q| <= Q = floor(B * 2^f + 1/2), so

    n * Q < 2^63   (and n * B * 2^f < 2^63)

guarantees exactness. `FixedPointCodec.check_capacity(n_max)` refuses a configuration that
breaks it, and `max_scale_bits(n_max, B)` picks the finest scale that satisfies it. Clients never
clip silently: a value outside [-B, B] or non-finite is an InputError.

Bounds for the statistics fedfleet aggregates (derivation in docs/secure-aggregation.md):
  - Fed3R: with at most N samples per client and features |z| <= F, the entries of
    A_k = sum z z^T are bounded by N F^2 and those of b_k = sum z y^T (one-hot y) by N F,
    so B = N * max(F^2, F)  (`fed3r_bound`).
  - FedAvg: n_k * Delta_k with |Delta| <= C (clipped) and n_k <= N: B = N * C; the weight
    n_k itself needs B >= N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .errors import ConfigError, InputError

RING_BITS = 64
_HALF_RING = 1 << (RING_BITS - 1)


def _integer_bound(bound: float, scale_bits: int) -> int:
    """Largest |rint(x * 2^f)| for |x| <= bound (rint rounds half to even; floor(.+1/2) >= it)."""
    return math.floor(Fraction(bound) * (1 << scale_bits) + Fraction(1, 2))


@dataclass(frozen=True)
class FixedPointCodec:
    """Encode/decode with scale 2^scale_bits and per-element bound `bound`."""

    scale_bits: int
    bound: float

    def __post_init__(self) -> None:
        if not isinstance(self.scale_bits, int) or isinstance(self.scale_bits, bool) \
                or not 0 <= self.scale_bits <= RING_BITS - 2:
            raise ConfigError(f"scale_bits must be an integer in 0..{RING_BITS - 2}, got {self.scale_bits!r}")
        if not isinstance(self.bound, (int, float)) or not math.isfinite(self.bound) or self.bound <= 0:
            raise ConfigError(f"bound must be a positive finite number, got {self.bound!r}")
        if _integer_bound(self.bound, self.scale_bits) >= _HALF_RING:
            raise ConfigError("bound * 2^scale_bits does not fit in int64")

    @property
    def integer_bound(self) -> int:
        return _integer_bound(self.bound, self.scale_bits)

    def check_capacity(self, n_max: int) -> None:
        """Refuse unless the sum of n_max encoded vectors cannot wrap modulo 2^64."""
        if n_max < 1:
            raise ConfigError("group size must be >= 1")
        exceeds = n_max * self.integer_bound >= _HALF_RING \
            or n_max * Fraction(self.bound) * (1 << self.scale_bits) >= _HALF_RING
        if exceeds:
            raise ConfigError(
                f"n_max * B * 2^f = {n_max} * {self.bound} * 2^{self.scale_bits} >= 2^63: the sum could "
                f"overflow; use scale_bits <= {max_scale_bits(n_max, self.bound)} or a smaller bound")

    def encode(self, values: np.ndarray) -> np.ndarray:
        """float vector -> uint64 words; InputError for non-finite or out-of-bound values."""
        x = np.asarray(values)
        if x.dtype.kind not in "fiu":
            raise InputError(f"input must be numeric, got dtype {x.dtype}")
        x = x.astype(np.float64, copy=False)
        # min/max propagate NaN and the comparisons below are then False: one check covers
        # NaN, +-inf and out-of-bound values without a temporary |x| array
        if x.size and not (-self.bound <= x.min() and x.max() <= self.bound):
            finite = np.isfinite(x)
            if not finite.all():
                raise InputError(f"input has {int((~finite).sum())} non-finite values")
            raise InputError(f"input value {float(np.abs(x).max())!r} outside the bound +-{self.bound}")
        # multiplying by a power of two is exact in float64, so rounding happens once, in rint
        scaled = x * float(1 << self.scale_bits)
        np.rint(scaled, out=scaled)
        return scaled.astype(np.int64).view(np.uint64)

    def to_signed(self, words: np.ndarray) -> np.ndarray:
        """uint64 ring elements -> the int64 integers they stand for (a view)."""
        return np.asarray(words, dtype=np.uint64).view(np.int64)

    def decode(self, words: np.ndarray) -> np.ndarray:
        """uint64 (a sum or a single vector) -> float64 x = q / 2^f (rounded to float64 when
        |q| > 2^53)."""
        return np.ldexp(self.to_signed(words).astype(np.float64), -self.scale_bits)


def max_scale_bits(n_max: int, bound: float) -> int:
    """Largest f with n_max * floor(B * 2^f + 1/2) < 2^63; ConfigError if even f = 0 fails."""
    if n_max < 1 or not math.isfinite(bound) or bound <= 0:
        raise ConfigError("need n_max >= 1 and a positive finite bound")
    best = None
    for f in range(RING_BITS - 1):
        fits = n_max * _integer_bound(bound, f) < _HALF_RING and n_max * Fraction(bound) * (1 << f) < _HALF_RING
        if not fits:
            break
        best = f
    if best is None:
        raise ConfigError(f"n_max * bound = {n_max} * {bound} does not fit in 2^63 even without fractional bits")
    return best


def fed3r_bound(max_samples: int, max_abs_feature: float) -> float:
    """Per-entry bound of Fed3R client statistics A_k = Z^T Z and b_k = Z^T Y (one-hot Y)."""
    if max_samples < 1 or not max_abs_feature > 0:
        raise ConfigError("need max_samples >= 1 and max_abs_feature > 0")
    return float(max_samples) * max(max_abs_feature**2, max_abs_feature)
