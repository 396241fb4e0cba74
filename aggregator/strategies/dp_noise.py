"""Where every central DP mechanism's noise comes from (DP-FedAvg, DP-LADD, DP Fed3R).

A cryptographic generator (:class:`CryptographicNoise`): each draw expands a fresh 256-bit seed
from the operating system (``os.urandom``) with the SecAgg mask PRG (AES-CTR,
``protocols.secagg.crypto.expand_mask``). Why not numpy's default generator: PCG64 is not
cryptographic, so noise whose generator state could be inferred could be predicted and subtracted;
a DP release's guarantee rests on nobody knowing its noise.

A test that compares two runs' bits (one aggregator's release and its shards') sets
``FEDFLEET_TEST_DP_NOISE_SEED``, and both runs draw the same noise from numpy seeded with it
(:class:`SeededNoise`): anyone who knows the seed can subtract it, so such a run is not private: the
aggregator logs it and every privacy report says so (``not_private``). Each release's seeded noise
is a function of the seed and the release's index (``noise_for``), which every mechanism
checkpoints, so a crash test can compare a restarted DP job's bits with an uninterrupted run's.

Every central release goes through one primitive, :func:`grid_gaussian_release`: Gaussian noise on
an integer grid, not a float added to a float. Theory of operation:

- The attack (Mironov 2012; Jin et al. 2022, "Are we there yet? Timing and floating-point attacks on
  differential privacy systems"). ``x + N(0, σ²)`` computed in float64 rounds the sum to the
  floats near it, whose spacing depends on x and on the noise, and the sampler's own floats are
  not spread like the real normal (gaps, uneven spacing). So which floats a release can be, and
  how likely, depends on x in its low-order bits in a way the noise does not hide: an attacker who
  sees the bits tells neighbouring x's apart far beyond ε (Mironov's example is a release no
  amount of noise protects).
- The grid. The values are rounded to a power-of-two grid g first, n = round(x/g) (exact in
  float64 at any size: x/g only moves the exponent, and from 2^52 on it is an integer already),
  integer noise K = round(σ_g·Z) is added, σ_g = σ/g, and the release is g·(n + K): every output
  an exact multiple of g (integers times a power of two). Below 2^53 n + K is computed without a
  rounding error; beyond it float64 returns the integer n + K correctly rounded, a function of
  that integer alone (post-processing of the release, the same bits for every x of that n + K).
  So no size of sum is refused: a refusal would be an outcome that depends on x with no noise at
  all (whether the job publishes or stops), and at a job's end (``dp_release`` "end") one that
  every restart met again. The release depends on x only through the integer vector n, and K's law
  does not depend on x at all: two x's in the same cells give the same bits from the same noise,
  and the floats a release can be are the grid's, for every x alike.
- The cost. Rounding moves each entry by at most g/2, so the rounded values' L2 sensitivity is at
  most Δ + g√d (x and its neighbour each rounded, d entries). The grid is chosen with
  g√d ≤ Δ·2^-20 (:func:`release_grid`) and the noise's stddev is σ·(1 + 2^-20): the noise is
  calibrated for the sensitivity Δ·(1 + 2^-20), so the release is the Gaussian mechanism of the
  caller's multiplier z = σ/Δ, which is what the accountant is told. The grid leaves
  σ_g = σ/g ≥ z·2^20·√d (about 10^9 for a model release): the integers near 0 are covered densely,
  no holes for an attacker to find.
- What is approximate. n + round(σ_g·Z) = round(n + σ_g·Z): with an ideal real-valued Z the release
  is a rounding (post-processing) of the continuous Gaussian mechanism on the integer vector n,
  exactly as private; the rounded Gaussian at σ_g ~ 10^9 is also, to far below any δ, the discrete
  Gaussian N_Z(0, σ_g²) of Canonne, Kamath & Steinke 2020. The real Z is a float from Box–Muller
  on 53-bit uniforms (:func:`standard_normals`): its tails end at about 8.57σ, where the normal's
  mass is about 10^-17 per entry, and its finite grid of values is far finer than one step of K
  (σ_g·2^-53 ≪ 1). That difference from the ideal law, the same for every x, is what goes into δ
  (d·10^-17, far below any δ a job may ask for).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Hashable, Mapping

import numpy as np

from protocols.secagg.crypto import expand_mask

log = logging.getLogger(__name__)

NOISE_SEED_ENV = "FEDFLEET_TEST_DP_NOISE_SEED"
SEED_BYTES = 32


def standard_normals(count: int, seed: bytes) -> np.ndarray:
    """``count`` independent N(0, 1) draws determined by ``seed``: pairs of uniforms on the 2^-53
    grid in (0, 1] from the mask PRG's 64-bit words (their top 53 bits), through the Box–Muller
    transform. The tails end at √(2·53·ln 2) ≈ 8.57 standard deviations, where the normal's mass is
    about 10^-17 per draw: what that truncation changes is far below any δ a job may ask for."""
    pairs = (count + 1) // 2
    words = expand_mask(seed, 2 * pairs)
    uniform = ((words >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53
    radius = np.sqrt(-2.0 * np.log(uniform[:pairs]))
    angle = 2.0 * math.pi * uniform[pairs:]
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]


class CryptographicNoise:
    """Gaussian noise from a cryptographic generator, drawn as numpy's ``Generator.normal`` draws it
    (the one method the mechanisms use): every call a fresh seed from the operating system."""

    def normal(self, loc: float = 0.0, scale: float = 1.0, size=None):
        shape = () if size is None else tuple(np.atleast_1d(np.asarray(size, dtype=np.int64)).tolist())
        draws = loc + scale * standard_normals(math.prod(shape), os.urandom(SEED_BYTES)).reshape(shape)
        return float(draws) if size is None else draws


class SeededNoise:
    """Tests only (``FEDFLEET_TEST_DP_NOISE_SEED``): numpy's generator seeded with ``seed``, one per
    release (:func:`noise_for`: from the seed and the release's index). Why not one stream per
    process: a restarted job drew its next release's noise from the stream's start again, the noise
    of the job's first release, so a DP job killed and resumed never had the bits of one run without
    a kill, and no crash test could compare them (a review's finding). ``normal`` draws from one
    stream seeded with ``seed`` alone (what a caller holding no release index gets)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._stream = np.random.default_rng(seed)

    def normal(self, loc: float = 0.0, scale: float = 1.0, size=None):
        return self._stream.normal(loc, scale, size)

    def at(self, stream: int, index: int) -> np.random.Generator:
        return np.random.default_rng((self.seed, stream, index))


NoiseSource = CryptographicNoise | SeededNoise | np.random.Generator     # what a mechanism draws from (``normal``)
MODEL_RELEASE, CENTER_RELEASE = 0, 1        # noise_for's streams: a mechanism's releases, DP Fed3R's feature center


def noise_for(source: NoiseSource, stream: int, index: int = 0) -> NoiseSource:
    """What release ``index`` of ``stream`` draws its noise from: a seeded source's generator of its
    own for it (the same bits in a job resumed from a checkpoint, which holds the index), else
    ``source`` itself (cryptographic: each draw fresh; a generator a test handed in: its stream)."""
    return source.at(stream, index) if isinstance(source, SeededNoise) else source


def noise_source() -> NoiseSource:
    """A mechanism's noise: cryptographic, or numpy seeded only under ``FEDFLEET_TEST_DP_NOISE_SEED``."""
    seed = os.environ.get(NOISE_SEED_ENV)
    if seed is None:
        return CryptographicNoise()
    if not seed.isdigit():
        raise ValueError(f"{NOISE_SEED_ENV} must be a non-negative integer, got {seed!r}")
    log.warning("DP noise seeded from %s=%s: this run's releases are NOT private (tests only)", NOISE_SEED_ENV, seed)
    return SeededNoise(int(seed))


def seeded_noise_warning() -> dict:
    """What every privacy report adds while the noise is seeded (a run that is not private), else {}:
    the report must not claim an ε that anyone knowing the seed can undo."""
    if os.environ.get(NOISE_SEED_ENV) is None:
        return {}
    return {"not_private": f"the noise is seeded by {NOISE_SEED_ENV} (tests only): anyone knowing the seed "
                           "can subtract it"}


GRID_MARGIN = 2.0 ** -20        # the rounding's share of the sensitivity: g√d ≤ Δ·GRID_MARGIN
EXACT_INTEGERS = 2.0 ** 52      # |K| below it: every integer step of the noise a float64 of its own


def release_grid(sensitivity, entries: int) -> np.ndarray:
    """g: the largest power of two with g·√d ≤ Δ·2^-20, for d = ``entries`` (one per Δ given)."""
    bound = np.asarray(sensitivity, dtype=np.float64) * GRID_MARGIN / math.sqrt(max(entries, 1))
    _, exponent = np.frexp(bound)                   # bound = m·2^e, ½ ≤ m < 1: 2^(e−1) ≤ bound < 2^e
    return np.ldexp(1.0, exponent - 1)


def grid_gaussian_release(values, stddev, sensitivity, source: NoiseSource) -> np.ndarray:
    """``values`` + N(0, σ²) on the release grid (module docstring): g·(round(x/g) + round(σ'/g·Z)),
    σ' = σ·(1 + 2^-20), Z the source's standard normals, one per entry; every entry an exact
    multiple of its g (:func:`release_grid`: g√d ≤ Δ·2^-20, d = ``values.size``).

    ``stddev`` σ is the noise calibrated to ``sensitivity`` Δ, the L2 sensitivity of all of
    ``values`` (σ = zΔ). Both may instead be given per entry (arrays broadcast to ``values``: Fed3R's
    blocks, each with its own stddev and its own sensitivity Δ_i) as long as the mean over the entries
    of (Δ_i/σ_i)² is at most 1/z², the squared sensitivity of the release in units of its noise: the
    rounding then moves that by at most √(Σ (g_i/σ_i)²) ≤ 2^-20/z, and the noise σ_i·(1 + 2^-20)
    again makes the release one of multiplier z. ValueError when some x is not finite (or x/g
    overflows), or the noise in grid steps reaches 2^52 (a draw of K, never of x: its integers would
    no longer each be a float64). A sum of any finite size is released (module docstring)."""
    values = np.asarray(values, dtype=np.float64)
    stddev = np.broadcast_to(np.asarray(stddev, dtype=np.float64), values.shape)
    sensitivity = np.broadcast_to(np.asarray(sensitivity, dtype=np.float64), values.shape)
    if not (np.isfinite(stddev).all() and np.isfinite(sensitivity).all() and (stddev > 0).all()
            and (sensitivity > 0).all()):
        raise ValueError("the noise stddev and the sensitivity must be positive finite numbers")
    grid = release_grid(sensitivity, values.size)
    cells = np.rint(values / grid)                  # exact: g is a power of two
    if not np.isfinite(cells).all():
        raise ValueError(f"a released value is not finite on the release grid (g = {float(grid.min()):.3g})")
    normals = np.asarray(source.normal(0.0, 1.0, values.size), dtype=np.float64).reshape(values.shape)
    steps = np.rint(stddev * (1.0 + GRID_MARGIN) / grid * normals)
    if not (np.abs(steps) < EXACT_INTEGERS).all():
        raise ValueError("the noise in grid steps reaches 2^52: the multiplier is too large for the release grid")
    return (cells + steps) * grid


def grid_gaussian_release_all(values: Mapping[Hashable, np.ndarray], stddev, sensitivity,
                              source: NoiseSource) -> dict:
    """:func:`grid_gaussian_release` of several arrays as one release (d counts all their entries):
    ``stddev`` and ``sensitivity`` one number for all, or a mapping with a number or array per key."""
    keys = list(values)
    arrays = [np.asarray(values[k], dtype=np.float64) for k in keys]

    def per_entry(given) -> np.ndarray:
        parts = [np.broadcast_to(np.asarray(given[k] if isinstance(given, Mapping) else given, dtype=np.float64),
                                 a.shape).ravel() for k, a in zip(keys, arrays)]
        return np.concatenate(parts) if parts else np.zeros(0)

    flat = np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0)
    released = grid_gaussian_release(flat, per_entry(stddev), per_entry(sensitivity), source)
    ends = np.cumsum([a.size for a in arrays])[:-1]
    return {k: part.reshape(a.shape) for k, a, part in zip(keys, arrays, np.split(released, ends))}
