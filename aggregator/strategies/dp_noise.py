"""Where every central DP mechanism's noise comes from (DP-FedAvg, DP-LADD, DP Fed3R).

OS entropy. A test that compares two runs' bits (one aggregator's release and its shards') sets
``FEDFLEET_TEST_DP_NOISE_SEED``, and both runs draw the same noise: anyone who knows the seed can
subtract it, so such a run is not private, and the aggregator logs that it is not.
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
    log.warning("DP noise seeded from %s=%s: this run's releases are NOT private (tests only)", NOISE_SEED_ENV, seed)
    return np.random.default_rng(int(seed))
