"""Who a bundle fetch believes: a device with the aggregator's key ignores forged artifact replies and
a replayed genuine "missing"; a device fetches from an aggregator requiring signatures (its asks
signed, the replies verified); a keyed device fetching from an unsigning aggregator says why it
timed out."""

import threading
import time

import numpy as np
import pytest

from aggregator.service.artifacts import ArtifactShelf
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.artifacts import ArtifactFetchError, fetch_bundle
from protocols.envelope import decode, encode
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

from artifact_serving import one_file_manifest, serve
from artifact_serving import bundle  # noqa: F401 (fixture)


def one_file_bundle(bundle, program: bytes = b"a program") -> tuple[bytes, str, dict[str, tuple[str, bytes]]]:
    """(manifest, its sha256, sha256 -> (name, bytes) of what an aggregator serves for it): a bundle of
    one file, ``head.pte``, holding ``program``."""
    import hashlib

    manifest = one_file_manifest(bundle, "head.pte", program)
    sha = hashlib.sha256(manifest).hexdigest()
    return manifest, sha, {sha: ("manifest.json", manifest), hashlib.sha256(program).hexdigest(): ("head.pte", program)}


def test_a_device_with_the_aggregators_key_ignores_forged_artifact_replies(broker, tmp_path, bundle):
    """A review's finding: the bundle fetch decoded its inbox without the aggregator's key, so one
    unsigned "missing" (or one file of other bytes) claiming to be the aggregator ended the fetch,
    and an enrolled device declined every task of the job with the forger's reason. With the key
    (``fedfleet device --aggregator-key``, passed on as ``verifier``) the forgeries are dropped and
    the aggregator's signed answer, slower here, is taken."""
    from protocols.identity import DeviceIdentity, sender_verifier
    from protocols.mqtt_link import MqttLink
    from protocols.payloads.artifacts import GET, artifact_message, missing_message
    from protocols.topics import AGGREGATOR_ID

    topics, cfg = Topics(), BrokerConfig.from_url(broker.url)
    manifest, sha, served = one_file_bundle(bundle)
    aggregator = DeviceIdentity.generate(AGGREGATOR_ID)
    link = MqttLink("forger-and-aggregator", cfg, on_message=lambda t, p: answer(p),
                    subscriptions=[(topics.outbox("cam1"), 1)])

    def answer(payload: bytes) -> None:
        ask = decode(payload)
        if ask.type != GET:
            return
        # the forger first (unsigned, at once, answering the ask it saw), the aggregator 1.5 s later (signed)
        wanted = ask.body["sha256"]
        link.publish(topics.inbox("cam1"), encode(missing_message(AGGREGATOR_ID, wanted, ask.id)))
        threading.Timer(1.5, lambda: link.publish(topics.inbox("cam1"), encode(
            artifact_message(AGGREGATOR_ID, wanted, *served[wanted]), signer=aggregator.sign))).start()

    link.start(timeout=30)
    try:
        with pytest.raises(ArtifactFetchError, match="holds no artifact"):      # no key: the forgery wins
            fetch_bundle("cam1", cfg, sha, tmp_path / "no-key", timeout_s=30, client_id="cam1.a")
        got = fetch_bundle("cam1", cfg, sha, tmp_path / "keyed", timeout_s=30, client_id="cam1.b",
                           verifier=sender_verifier(AGGREGATOR_ID, aggregator.public_key_bytes))
        assert got.read_bytes() == manifest and (got.parent / "head.pte").read_bytes() == b"a program"
    finally:
        link.stop()


def test_a_replayed_genuine_missing_does_not_end_a_later_fetch(broker, tmp_path, bundle):
    """A review's finding: a signed "missing" the aggregator once sent (asked before the bundle was
    on its shelf), recorded and replayed, ended every later fetch of that bundle at once, and the
    device declined the job's tasks. A "missing" ends a fetch only when it answers one of that
    fetch's own asks (``request``, the ask's id), so the replay is passed over and the file taken."""
    from protocols.identity import DeviceIdentity, sender_verifier
    from protocols.mqtt_link import MqttLink
    from protocols.payloads.artifacts import GET, artifact_message, missing_message
    from protocols.topics import AGGREGATOR_ID

    topics, cfg = Topics(), BrokerConfig.from_url(broker.url)
    manifest, sha, served = one_file_bundle(bundle)
    aggregator = DeviceIdentity.generate(AGGREGATOR_ID)
    recorded = encode(missing_message(AGGREGATOR_ID, sha, "ab" * 16), signer=aggregator.sign)   # an earlier ask's answer
    asks = []
    link = MqttLink("replayer-and-aggregator", cfg, on_message=lambda t, p: answer(p),
                    subscriptions=[(topics.outbox("cam1"), 1)])

    def answer(payload: bytes) -> None:
        ask = decode(payload)
        if ask.type != GET:
            return
        wanted = ask.body["sha256"]
        asks.append(wanted)
        link.publish(topics.inbox("cam1"), recorded)                 # the replay, at once
        if asks.count(wanted) == 1:                                  # the aggregator, 1 s later: the file
            threading.Timer(1.0, lambda: link.publish(topics.inbox("cam1"), encode(
                artifact_message(AGGREGATOR_ID, wanted, *served[wanted]), signer=aggregator.sign))).start()

    link.start(timeout=30)
    try:
        got = fetch_bundle("cam1", cfg, sha, tmp_path / "keyed", timeout_s=30, client_id="cam1.r",
                           verifier=sender_verifier(AGGREGATOR_ID, aggregator.public_key_bytes))
        assert got.read_bytes() == manifest and asks
        # the same "missing" answering this fetch's own ask ends it at once
        link.stop()
        link = MqttLink("aggregator", cfg, on_message=lambda t, p: link.publish(topics.inbox("cam1"), encode(
            missing_message(AGGREGATOR_ID, sha, decode(p).id), signer=aggregator.sign)),
            subscriptions=[(topics.outbox("cam1"), 1)])
        link.start(timeout=30)
        started = time.monotonic()
        with pytest.raises(ArtifactFetchError, match="holds no artifact"):
            fetch_bundle("cam1", cfg, sha, tmp_path / "missing", timeout_s=30, client_id="cam1.m",
                         verifier=sender_verifier(AGGREGATOR_ID, aggregator.public_key_bytes))
        assert time.monotonic() - started < 10
    finally:
        link.stop()


def test_a_device_fetches_a_bundle_from_an_aggregator_requiring_signatures(broker, tmp_path, bundle):
    """A review's finding: the device command's bundle fetch (``FetchedBundles``) sent its requests
    unsigned, so an aggregator run with --require-signatures dropped every one and a fully secured
    device could fetch no bundle (at boot, or for a job naming one). Its requests are signed now,
    its replies (chunked, signed chunk by chunk) verified with the aggregator's key."""
    from aggregator.storage.store import Store
    from fedfleet.device_bundles import FetchedBundles
    from protocols.identity import DeviceIdentity
    from protocols.topics import AGGREGATOR_ID

    shelf = ArtifactShelf()
    sha = shelf.add_bundle(bundle)
    aggregator = DeviceIdentity.generate(AGGREGATOR_ID)
    job = Fed3RJob(Fed3RConfig(num_classes=10, feature_dim=4, expected_devices=99, start_timeout_s=1e6))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "agg",
                            ServiceSettings(require_signatures=True), store=Store(tmp_path / "state.db"),
                            identity=aggregator, artifacts=shelf)
    creds = svc.enroll("cam1").to_dict()
    t = threading.Thread(target=lambda: svc.run(timeout_s=120), daemon=True)
    t.start()
    try:
        device = DeviceIdentity.from_pem("cam1", creds["private_key_pem"].encode())
        fetched = FetchedBundles("cam1", BrokerConfig.from_url(broker.url), Topics(), tmp_path / "bundles",
                                 "onnxruntime", None, default=None, local=None,
                                 aggregator_key=bytes.fromhex(creds["aggregator_public_key"]), signer=device.sign)
        extractor, _ = fetched.get(sha)
        x = np.random.default_rng(0).integers(0, 256, (2, 28, 28), dtype=np.uint8)
        assert extractor.extract(x).shape == (2, 1280)
        assert not svc.active.stats.rejections.get("bad signature")
        # a bundle with no program for the device's runtime declines the job's task with the reason
        # (a review's finding: the runtime's error escaped as an unexpected error, with a traceback)
        from edge_client.agent import TaskDeclined

        executorch_device = FetchedBundles("cam1", BrokerConfig.from_url(broker.url), Topics(), tmp_path / "bundles-x",
                                           "executorch", None, default=None, local=None,
                                           aggregator_key=bytes.fromhex(creds["aggregator_public_key"]), signer=device.sign)
        with pytest.raises(TaskDeclined, match=f"bundle {sha[:16]} unavailable"):
            executorch_device("mobilenet_v2", 32, "", bundle_sha256=sha)
    finally:
        svc.stop()
        t.join(10)


def test_a_keyed_device_fetching_from_an_unsigning_aggregator_says_why_it_timed_out(broker, tmp_path, bundle):
    """A review's finding: a device given the aggregator's key (``--aggregator-key``) drops the
    replies of an aggregator run without ``--identity`` (it signs nothing), and its fetch timed out
    saying only that no artifact came. The timeout now names the drop and the two ways out."""
    from protocols.identity import DeviceIdentity, sender_verifier
    from protocols.topics import AGGREGATOR_ID

    shelf = ArtifactShelf()
    sha = shelf.add_bundle(bundle)
    svc, t = serve(broker, tmp_path, shelf)                  # no identity: its replies are unsigned
    try:
        # without the key the unsigned reply is taken (a development broker): the service is up
        assert fetch_bundle("cam1", BrokerConfig.from_url(broker.url), sha, tmp_path / "open",
                            timeout_s=60).exists()
        key = DeviceIdentity.generate(AGGREGATOR_ID).public_key_bytes
        with pytest.raises(ArtifactFetchError, match=r"within 4s; a message was dropped: unsigned message from "
                                                     r"'aggregator' \(.*--identity.*--aggregator-key\)"):
            fetch_bundle("cam1", BrokerConfig.from_url(broker.url), sha, tmp_path / "keyed", timeout_s=4,
                         verifier=sender_verifier(AGGREGATOR_ID, key))
        assert not (tmp_path / "keyed").exists()
    finally:
        svc.stop()
        t.join(10)
