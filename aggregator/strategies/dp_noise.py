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
"""

from __future__ import annotations

import logging
import math
import os

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
