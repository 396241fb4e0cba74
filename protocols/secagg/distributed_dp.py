"""Distributed differential privacy inside the SecAgg ring: every device adds its share of noise.

The server of a DP secure round never sees an un-noised sum: each device adds Skellam noise
(the difference of two Poisson variables, Agarwal, Kairouz & Liu 2021) to its own vector, as
integers at the round's fixed-point scale 2^-f, before masking. The Skellam family is closed
under addition: s survivors adding Sk(μ) each give exactly Sk(sμ) in the sum, variance 2sμ.

Both sides share this module: the job picks the per-device stddev, the scale f (pinned in the
signed round configuration) and the bound (data bound plus noise headroom); the device calls
:func:`add_skellam_noise`.

- Dropouts: a sum is only ever revealed with at least t (the round's threshold) survivors, so
  devices calibrate to t: σ_dev = σ / √t gives every revealed sum a variance of at least σ²
  (more, s/t·σ², when s > t survive) — the guarantee never depends on who drops out.
- Scale: f puts σ_dev at about 2^NOISE_BITS ring units, so the noise is resolved to ~2^-20 of its
  stddev and Sk(μ) with μ ≈ 2^39 is, for the accountant, the Gaussian of the same variance (the
  Skellam RDP bound exceeds the Gaussian's by O(Δ₁/μ), far below the ε reported).
- Exactness: the device rounds its value to q = rint(x·2^f) itself and adds the integer noise k,
  in float64 below 2^52, so the client's encoder meets q + k exactly: the ring sum is
  Σ q_i + Sk(sμ), nothing else.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import ConfigError
from .fixedpoint import max_scale_bits

NOISE_BITS = 20            # a device's noise stddev is about 2^20 ring units
MIN_NOISE_BITS = 10        # below this the Skellam noise is too coarse to account as a Gaussian
EXACT_BITS = 52            # |q + k| < 2^52: the float64 path to the encoder is exact
HEADROOM_SIGMAS = 12.0     # the bound covers |x| + 12 σ_dev: a device declines with probability < 1e-30 per entry
# The largest Poisson mean numpy draws (Long.MAX_VALUE - 10·√Long.MAX_VALUE); past it a sampler's
# draw saturates (Java's once released the values un-noised): every device refuses such a round,
# by this rule rather than by its sampler's own error (SkellamNoise.POISSON_LAM_MAX on Java).
POISSON_LAM_MAX = 9.223372006484771e18


def device_stddev(total_stddev: float, threshold: int) -> float:
    """σ_dev = σ/√t: any sum of at least t devices' noise has variance ≥ σ²."""
    if not (math.isfinite(total_stddev) and total_stddev > 0) or threshold < 1:
        raise ConfigError("need a positive noise stddev and threshold >= 1")
    return total_stddev / math.sqrt(threshold)


def noisy_bound(data_bound: float, stddev: float) -> float:
    """The round's per-entry bound: the data's plus room for the noise."""
    return float(data_bound) + HEADROOM_SIGMAS * stddev


def noise_scale_bits(stddev: float, bound: float, members: int) -> int:
    """f for a DP round: σ_dev·2^f ≈ 2^NOISE_BITS, within the ring's capacity and exact in float64."""
    f = min(NOISE_BITS - math.ceil(math.log2(stddev)), max_scale_bits(members, bound),
            EXACT_BITS - 1 - math.ceil(math.log2(bound)))
    if f < 0 or math.log2(stddev) + f < MIN_NOISE_BITS:
        raise ConfigError(f"noise stddev {stddev:g} cannot be resolved with bound {bound:g} and {members} "
                          "members in the 64-bit ring")
    return f


def add_skellam_noise(values: np.ndarray, stddev: float, scale_bits: int, rng: np.random.Generator,
                      noised: slice = slice(None)) -> np.ndarray:
    """x rounded to the 2^-f grid plus Sk(μ)·2^-f on ``noised`` entries, μ = (σ_dev 2^f)²/2."""
    if not (math.isfinite(stddev) and stddev > 0) or not 0 <= scale_bits <= EXACT_BITS:
        raise ConfigError("bad noise stddev or scale bits")
    mu = (stddev * 2.0 ** scale_bits) ** 2 / 2
    if not mu <= POISSON_LAM_MAX:
        raise ConfigError(f"noise stddev {stddev:g} at scale bits {scale_bits} is too large to draw "
                          f"(Poisson mean {mu:.3g} > {POISSON_LAM_MAX:.3g})")
    q = np.rint(np.ldexp(np.asarray(values, dtype=np.float64), scale_bits))
    size = q[noised].shape
    q[noised] += (rng.poisson(mu, size) - rng.poisson(mu, size)).astype(np.float64)
    if q.size and np.abs(q).max() >= 2.0 ** EXACT_BITS:
        raise ConfigError("noisy value beyond 2^52 ring units: scale bits too fine for this bound")
    return np.ldexp(q, -scale_bits)


# Adaptive clipping under distributed DP (Andrew et al. 2021; the plain rule is
# aggregator/strategies/dp_fedavg.py AdaptiveClipNorm): each device of a DP-FedAvg round appends
# its clipped-indicator bit, centred, (1[‖Δ_k‖ ≤ C] − ½)·s, as one more noised entry of its vector.
# Centred, so that one device more or less moves the sum by s/2 (the plain rule's COUNT_SENSITIVITY
# ½, in count units), whatever its bit; s = σ/σ_b, so that the same per-entry noise that gives the
# update sum stddev σ (at t survivors) gives Σ (b_k − ½) stddev σ_b once divided by s.
def clip_bit_scale(total_stddev: float, count_stddev: float) -> float:
    """s of the bit entry: the round's update noise σ (on the sum) over the count's σ_b."""
    if not (math.isfinite(total_stddev) and total_stddev > 0 and math.isfinite(count_stddev) and count_stddev > 0):
        raise ConfigError("need a positive update noise stddev and count stddev")
    return total_stddev / count_stddev


def clip_bit(norm: float, clip_norm: float, scale: float) -> float:
    """A device's bit entry before its noise: (1[‖Δ‖ ≤ C] − ½)·s."""
    return (0.5 if norm <= clip_norm else -0.5) * scale


# the sum's bit entry may pass |S|·s/2 by this many stddevs of its noise: an honest group's does with
# probability < 2e-9 (a round lost), and a forged entry hides in at most this much noise
BIT_SUM_HEADROOM_SIGMAS = 6.0


def clip_bit_sum_bound(scale: float, stddev: float, members: int) -> float:
    """What the bit entries of ``members`` honest devices (noise share ``stddev`` each) sum to, at
    most: |S|·s/2 plus BIT_SUM_HEADROOM_SIGMAS of the summed noise's stddev σ_dev·√|S| (σ_b·√(|S|/t)
    in counts). The server sees only the sum, so this is all it can check: a forged entry beyond it
    is refused; one within it moves Σ (b_k − ½) by at most its peers' unused room and that
    headroom (docs/secure-aggregation.md)."""
    return members * scale / 2 + BIT_SUM_HEADROOM_SIGMAS * stddev * math.sqrt(members)
