"""The device command's deployment follower keeps the held-out features of only the last few bundles.

A hostile review of the device's input paths found that ``fedfleet device --deployments`` kept the
held-out split's features of every bundle an assignment ever named (``follow_deployments``' holdout),
for the process's life: each assignment naming a new ``bundle_sha256`` (signed by the aggregator,
one message) added n x d floats that nothing ever removed, while the bundle's program itself was
dropped after ``MAX_HELD_EXTRACTORS`` others. A device following rollouts for a year, or an
aggregator naming bundle after bundle, grew without bound. Now the features are kept for as many
bundles as the device keeps programs, the least recently asked for leaving first: asked for again,
they are extracted again (the same features).

Over a real mosquitto: the follower is the one ``fedfleet device`` starts.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import numpy as np

from edge_client.tasks.extractors import MAX_HELD_EXTRACTORS
from fedfleet.device import follow_deployments
from protocols.mqtt_link import BrokerConfig

DIM = 6
BUNDLES = [f"{i + 1:064x}" for i in range(3 * MAX_HELD_EXTRACTORS)]


class CountingBundles:
    """The device's FetchedBundles as the follower uses it: ``get(sha)`` -> (extractor, weights);
    each bundle's extractor gives features that name the bundle (its index in every entry)."""

    def __init__(self):
        self.extracted: list[str] = []

    def get(self, sha: str):
        bundles = self

        class Extractor:
            def extract(self, images):
                bundles.extracted.append(sha)
                return np.full((len(images), DIM), float(BUNDLES.index(sha)), np.float32)

        return Extractor(), "0" * 64


def expected_features(sha: str, n: int) -> np.ndarray:
    return np.full((n, DIM), float(BUNDLES.index(sha)), np.float32)


def test_held_out_features_are_kept_for_the_last_bundles_only(broker, tmp_path):
    images = np.zeros((5, 8, 8), np.uint8)
    labels = np.arange(5) % 2
    bundles = CountingBundles()
    args = SimpleNamespace(id="cam1", bundle_sha=None, deployments=tmp_path / "slot", topic_root="fedfleet",
                           aggregator_key=None)
    follower = follow_deployments(args, BrokerConfig.from_url(broker.url), bundles, images, labels, signer=None)
    try:
        held = []
        for sha in BUNDLES:             # assignments naming bundle after bundle
            features, got_labels = follower.holdout(sha)
            np.testing.assert_array_equal(features, expected_features(sha, len(images)))
            np.testing.assert_array_equal(got_labels, labels)
            held.append(weakref.ref(features))
            del features
        gc.collect()
        alive = [sha for sha, ref in zip(BUNDLES, held) if ref() is not None]
        assert alive == BUNDLES[-MAX_HELD_EXTRACTORS:], "features of bundles past the last few stay in memory"
        assert bundles.extracted == BUNDLES                 # each extracted once so far

        # the latest are still served from memory; an earlier one is extracted again, the same features
        for sha in BUNDLES[-MAX_HELD_EXTRACTORS:]:
            np.testing.assert_array_equal(follower.holdout(sha)[0], expected_features(sha, len(images)))
        assert bundles.extracted == BUNDLES
        np.testing.assert_array_equal(follower.holdout(BUNDLES[0])[0], expected_features(BUNDLES[0], len(images)))
        assert bundles.extracted == BUNDLES + [BUNDLES[0]]
    finally:
        follower.stop()
