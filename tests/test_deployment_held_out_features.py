"""The device command's deployment follower: held-out features of the last bundles only, fetched in a window.

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


def test_a_bundle_the_follower_fetches_is_waited_for_no_longer_than_its_window(broker, tmp_path, monkeypatch):
    """The follower fetched an assignment's bundle with no time bound of its own: outside any task,
    ``fetch_bundle`` waited 120 s for each of up to 32 files, holding the device's bundle lock (every
    task naming a bundle waited behind it) for an assignment naming a bundle nobody serves. Now a
    fetch for held-out features ends with the follower's window (``HELD_OUT_FETCH_S``), as a task's
    fetch ends with its deadline. No aggregator answers here: the fetch can only time out."""
    import threading
    import time

    import fedfleet.device as device
    from edge_client.artifacts import ArtifactFetchError
    from protocols.topics import Topics

    monkeypatch.setattr(device, "HELD_OUT_FETCH_S", 1.0, raising=False)
    broker_config = BrokerConfig.from_url(broker.url)
    bundles = device.FetchedBundles("cam1", broker_config, Topics(), tmp_path / "bundles", "onnxruntime", None,
                                    default=None, local=None)
    args = SimpleNamespace(id="cam1", bundle_sha=None, deployments=tmp_path / "slot", topic_root="fedfleet",
                           aggregator_key=None)
    follower = follow_deployments(args, broker_config, bundles, np.zeros((2, 8, 8), np.uint8), np.arange(2),
                                  signer=None)
    outcome = []

    def ask():
        try:
            follower.holdout("ab" * 32)
        except Exception as exc:        # noqa: BLE001 (what the follower's _adopt catches)
            outcome.append(exc)

    try:
        started = time.monotonic()
        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(30)
        assert not asking.is_alive(), "the follower's fetch outlasted its window"
        assert time.monotonic() - started < 15
        assert len(outcome) == 1 and isinstance(outcome[0], ArtifactFetchError), outcome
        assert bundles.lock.acquire(timeout=1)          # the bundle lock is free again
        bundles.lock.release()
    finally:
        follower.stop()
