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
import pytest

from edge_client.tasks.extractors import MAX_HELD_EXTRACTORS
from fedfleet.device import follow_deployments
from protocols.mqtt_link import BrokerConfig

DIM = 6
BUNDLES = [f"{i + 1:064x}" for i in range(3 * MAX_HELD_EXTRACTORS)]


class CountingBundles:
    """The device's FetchedBundles as the follower uses it: ``extractor_for(sha)`` -> (extractor, weights);
    each bundle's extractor gives features that name the bundle (its index in every entry)."""

    def __init__(self):
        self.extracted: list[str] = []

    def extractor_for(self, sha: str):
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
    from fedfleet.device_bundles import BundleUnusable, FetchedBundles
    from protocols.topics import Topics

    monkeypatch.setattr(device, "HELD_OUT_FETCH_S", 1.0, raising=False)
    broker_config = BrokerConfig.from_url(broker.url)
    bundles = FetchedBundles("cam1", broker_config, Topics(), tmp_path / "bundles", "onnxruntime", None,
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
        assert len(outcome) == 1 and isinstance(outcome[0], BundleUnusable), outcome
        assert isinstance(outcome[0].__cause__, ArtifactFetchError), outcome
        assert bundles.lock.acquire(timeout=1)          # the bundle lock is free again
        bundles.lock.release()
    finally:
        follower.stop()


def counted_fetches(monkeypatch) -> list[str]:
    """The bundles FetchedBundles goes to the broker for, in order (each fetch still runs)."""
    from fedfleet.device_bundles import FetchedBundles

    fetched: list[str] = []
    fetch = FetchedBundles._fetch

    def counting(self, sha):
        fetched.append(sha)
        return fetch(self, sha)

    monkeypatch.setattr(FetchedBundles, "_fetch", counting)
    return fetched


def start_follower(broker, tmp_path, monkeypatch, runtime: str):
    """The device's bundles (``runtime``) and the follower ``fedfleet device --deployments`` starts on them;
    no aggregator answers on this broker, so a fetch can only time out (within a 1 s window)."""
    import fedfleet.device as device
    from fedfleet.device_bundles import FetchedBundles
    from protocols.topics import Topics

    monkeypatch.setattr(device, "HELD_OUT_FETCH_S", 1.0)
    broker_config = BrokerConfig.from_url(broker.url)
    bundles = FetchedBundles("cam1", broker_config, Topics(), tmp_path / "bundles", runtime, None,
                             default=None, local=None)
    args = SimpleNamespace(id="cam1", bundle_sha=None, deployments=tmp_path / "slot", topic_root="fedfleet",
                           aggregator_key=None)
    follower = follow_deployments(args, broker_config, bundles, np.zeros((2, 8, 8), np.uint8), np.arange(2),
                                  signer=None)
    return bundles, follower


def test_a_follower_on_an_eager_device_is_refused_before_any_fetch(broker, tmp_path, monkeypatch):
    """A review's leftover: the follower asked FetchedBundles.get directly, skipping what a task's
    request checks, so a device running --runtime eager (which cannot run a bundle) fetched each
    assignment's bundle whole and only then failed. Now it is refused at once, as a task is."""
    from fedfleet.device_bundles import BundleUnusable

    fetched = counted_fetches(monkeypatch)
    _, follower = start_follower(broker, tmp_path, monkeypatch, "eager")
    try:
        with pytest.raises(Exception) as refused:
            follower.holdout("ab" * 32)
        assert fetched == [], "an eager device fetched a bundle it cannot run"
        assert not (tmp_path / "bundles").exists()
        assert isinstance(refused.value, BundleUnusable) and "eager torch" in str(refused.value)
    finally:
        follower.stop()


def test_a_bundle_that_could_not_be_fetched_is_not_fetched_again_by_the_follower_or_a_task(broker, tmp_path,
                                                                                          monkeypatch):
    """A review's leftover: the follower skipped the device's memory of bundles it could not fetch, so
    a bundle nobody serves was fetched again at each of the follower's retries (each waiting out its
    window on the bundle lock). Now the follower and the tasks share that memory: within its window a
    failed bundle is refused at once with the first failure's reason, whoever asks; past it, asked again."""
    import time

    from edge_client.agent import TaskDeclined
    from edge_client.artifacts import UNAVAILABLE_FOR_S
    from edge_client.work_deadline import working_until

    fetched = counted_fetches(monkeypatch)
    bundles, follower = start_follower(broker, tmp_path, monkeypatch, "onnxruntime")
    sha, other = "ab" * 32, "cd" * 32
    try:
        with pytest.raises(Exception) as first:
            follower.holdout(sha)
        assert fetched == [sha]
        with pytest.raises(Exception) as again:           # the follower's retry
            follower.holdout(sha)
        assert fetched == [sha], "the follower fetched a bundle that failed a moment ago again"
        assert str(again.value) == str(first.value) and f"bundle {sha[:16]} unavailable" in str(first.value)
        with working_until(time.time() + 60), pytest.raises(TaskDeclined) as declined:     # a task naming it
            bundles("mobilenet_v2", 32, "", bundle_sha256=sha)
        assert fetched == [sha] and str(declined.value) == str(first.value)

        # the other way round: a task's failed fetch spares the follower another
        with working_until(time.time() + 1.0), pytest.raises(TaskDeclined) as task_failed:
            bundles("mobilenet_v2", 32, "", bundle_sha256=other)
        assert fetched == [sha, other]
        with pytest.raises(Exception) as follower_refused:
            follower.holdout(other)
        assert fetched == [sha, other] and str(follower_refused.value) == str(task_failed.value)

        # remembered for a while only: past it, the follower asks again
        bundles.unavailable.expire(time.monotonic() + UNAVAILABLE_FOR_S + 1)
        with pytest.raises(Exception):
            follower.holdout(sha)
        assert fetched == [sha, other, sha]
    finally:
        follower.stop()
