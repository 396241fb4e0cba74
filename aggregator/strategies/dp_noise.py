"""Where every central DP mechanism's noise comes from (DP-FedAvg, DP-LADD, DP Fed3R).

OS entropy. A test that compares two runs' bits (one aggregator's release and its shards') sets
``FEDFLEET_TEST_DP_NOISE_SEED``, and both runs draw the same noise: anyone who knows the seed can
subtract it (and a restarted process draws the same noise again), so such a run is not private:
the aggregator logs it and every privacy report says so (``not_private``).
"""

from __future__ import annotations

import logging
import os

import numpy as np

log = logging.getLogger(__name__)

NOISE_SEED_ENV = "FEDFLEET_TEST_DP_NOISE_SEED"


def noise_source() -> np.random.Generator:
    """A fresh generator for a mechanism's noise (seeded only under ``FEDFLEET_TEST_DP_NOISE_SEED``)."""
    seed = os.environ.get(NOISE_SEED_ENV)
    if seed is None:
        return np.random.default_rng()
    if not seed.isdigit():
        raise ValueError(f"{NOISE_SEED_ENV} must be a non-negative integer, got {seed!r}")
    log.warning("DP noise seeded from %s=%s: this run's releases are NOT private (tests only)", NOISE_SEED_ENV, seed)
    return np.random.default_rng(int(seed))


def seeded_noise_warning() -> dict:
    """What every privacy report adds while the noise is seeded (a run that is not private), else {}:
    the report must not claim an ε that anyone knowing the seed can undo."""
    if os.environ.get(NOISE_SEED_ENV) is None:
        return {}
    return {"not_private": f"the noise is seeded by {NOISE_SEED_ENV} (tests only): anyone knowing the seed "
                           "can subtract it"}
