"""Fixed-point encoding of float64 vectors into Z_{2^r} (two's complement) and its bound.

The ring is r = 64 bits (the default: Fed3R's statistics need its precision to stay exact) or
r = 32 (``RoundConfig.ring_bits``), which halves the masked vectors and the mask keystream where
the bound and the precision a job needs allow it. q = rint(x * 2^f) as a signed r-bit integer,
stored as the unsigned r-bit word with the same bits. Sums of such words taken modulo 2^r and
read back as signed integers equal the integer sum exactly as long as the true sum lies in
[-2^(r-1), 2^(r-1)). With n clients each sending |x| <= B, |q| <= Q = floor(B * 2^f + 1/2), so

    n * Q < 2^(r-1)   (and n * B * 2^f < 2^(r-1))

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

RING_BITS = 64                 # the default ring
RINGS = (32, 64)               # the ring widths a round may declare
_WORDS = {32: (np.dtype("<u4"), np.dtype("<i4")), 64: (np.dtype("<u8"), np.dtype("<i8"))}
RING_WORDS = tuple(unsigned for unsigned, _signed in _WORDS.values())   # what a mask accumulator may hold


def check_ring_bits(ring_bits: object) -> int:
    if not isinstance(ring_bits, int) or isinstance(ring_bits, bool) or ring_bits not in RINGS:
        raise ConfigError(f"ring_bits must be the integer 32 or 64, got {ring_bits!r}")
    return ring_bits


def _integer_bound(bound: float, scale_bits: int) -> int:
    """Largest |rint(x * 2^f)| for |x| <= bound (rint rounds half to even; floor(.+1/2) >= it)."""
    return math.floor(Fraction(bound) * (1 << scale_bits) + Fraction(1, 2))


@dataclass(frozen=True)
class FixedPointCodec:
    """Encode/decode with scale 2^scale_bits and per-element bound `bound`."""

    scale_bits: int
    bound: float
    ring_bits: int = RING_BITS

    def __post_init__(self) -> None:
        check_ring_bits(self.ring_bits)
        if not isinstance(self.scale_bits, int) or isinstance(self.scale_bits, bool) \
                or not 0 <= self.scale_bits <= self.ring_bits - 2:
            raise ConfigError(f"scale_bits must be an integer in 0..{self.ring_bits - 2}, got {self.scale_bits!r}")
        if not isinstance(self.bound, (int, float)) or not math.isfinite(self.bound) or self.bound <= 0:
            raise ConfigError(f"bound must be a positive finite number, got {self.bound!r}")
        if _integer_bound(self.bound, self.scale_bits) >= 1 << (self.ring_bits - 1):
            raise ConfigError(f"bound * 2^scale_bits does not fit in a word of the {self.ring_bits}-bit ring")

    @property
    def word(self) -> np.dtype:
        """The ring's unsigned word (numpy little-endian dtype)."""
        return _WORDS[self.ring_bits][0]

    @property
    def integer_bound(self) -> int:
        return _integer_bound(self.bound, self.scale_bits)

    def check_capacity(self, n_max: int) -> None:
        """Refuse unless the sum of n_max encoded vectors cannot wrap modulo 2^r."""
        if n_max < 1:
            raise ConfigError("group size must be >= 1")
        if not _fits(n_max, self.bound, self.scale_bits, self.ring_bits):
            try:
                advice = f"use scale_bits <= {max_scale_bits(n_max, self.bound, self.ring_bits)} or a smaller bound"
            except ConfigError:
                advice = "use a smaller bound or a wider ring"
            raise ConfigError(
                f"n_max * B * 2^f = {n_max} * {self.bound} * 2^{self.scale_bits} >= 2^{self.ring_bits - 1}: "
                f"the sum could overflow the {self.ring_bits}-bit ring; {advice}")

    def encode(self, values: np.ndarray) -> np.ndarray:
        """float vector -> the ring's unsigned words; InputError for non-finite or out-of-bound values."""
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
        unsigned, signed = _WORDS[self.ring_bits]
        return scaled.astype(signed).view(unsigned)

    def to_signed(self, words: np.ndarray) -> np.ndarray:
        """Ring elements (unsigned words) -> the signed integers they stand for (a view)."""
        unsigned, signed = _WORDS[self.ring_bits]
        return np.asarray(words, dtype=unsigned).view(signed)

    def decode(self, words: np.ndarray) -> np.ndarray:
        """Ring words (a sum or a single vector) -> float64 x = q / 2^f (rounded to float64 when
        |q| > 2^53)."""
        return np.ldexp(self.to_signed(words).astype(np.float64), -self.scale_bits)


def _fits(n_max: int, bound: float, scale_bits: int, ring_bits: int) -> bool:
    half = 1 << (ring_bits - 1)
    return n_max * _integer_bound(bound, scale_bits) < half and n_max * Fraction(bound) * (1 << scale_bits) < half


def max_scale_bits(n_max: int, bound: float, ring_bits: int = RING_BITS) -> int:
    """Largest f with n_max * floor(B * 2^f + 1/2) < 2^(r-1); ConfigError if even f = 0 fails."""
    if n_max < 1 or not math.isfinite(bound) or bound <= 0:
        raise ConfigError("need n_max >= 1 and a positive finite bound")
    check_ring_bits(ring_bits)
    best = None
    for f in range(ring_bits - 1):
        if not _fits(n_max, bound, f, ring_bits):
            break
        best = f
    if best is None:
        raise ConfigError(f"n_max * bound = {n_max} * {bound} does not fit in 2^{ring_bits - 1} even without "
                          "fractional bits")
    return best


def fed3r_bound(max_samples: int, max_abs_feature: float) -> float:
    """Per-entry bound of Fed3R client statistics A_k = Z^T Z and b_k = Z^T Y (one-hot Y)."""
    if max_samples < 1 or not max_abs_feature > 0:
        raise ConfigError("need max_samples >= 1 and max_abs_feature > 0")
    return float(max_samples) * max(max_abs_feature**2, max_abs_feature)
