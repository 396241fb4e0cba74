"""What a bundle fetch holds in memory against forged or replayed chunks: no reply larger than what it
asked for, room for the real reply next to a replayed chunk of another message, and no more than
the file's size for one sender, however many messages it starts."""

import pytest

from edge_client.artifacts import ArtifactFetchError, fetch_bundle
from protocols.envelope import decode, encode
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

from artifact_serving import one_file_manifest
from artifact_serving import bundle  # noqa: F401 (fixture)


def test_a_fetch_holds_no_reply_larger_than_what_it_asked_for(broker, tmp_path):
    """A review's finding: a device without the aggregator's key takes whatever its broker delivers,
    and the chunks of a forged reply were held up to the 512 MiB any message may be. A reply now may
    be only as large as what was asked for: a manifest (at most MAX_MANIFEST_BYTES), so the first
    chunk of a 2 MiB "manifest" is dropped at once, and the timeout says why."""
    import hashlib

    from edge_client.artifacts import REPLY_OVERHEAD_BYTES
    from protocols.bundle_manifest import MAX_MANIFEST_BYTES
    from protocols.chunking import split
    from protocols.mqtt_link import MqttLink
    from protocols.payloads.artifacts import GET, artifact_message
    from protocols.topics import AGGREGATOR_ID

    topics, cfg = Topics(), BrokerConfig.from_url(broker.url)
    sha = hashlib.sha256(b"{}").hexdigest()
    big = encode(artifact_message(AGGREGATOR_ID, sha, "manifest.json", bytes(2 * MAX_MANIFEST_BYTES)))
    first_chunk = split(big, decode(big).id, AGGREGATOR_ID)[0]
    link = MqttLink("forger", cfg, on_message=lambda t, p: decode(p).type == GET and link.publish(
        topics.inbox("cam1"), first_chunk), subscriptions=[(topics.outbox("cam1"), 1)])
    link.start(timeout=30)
    try:
        with pytest.raises(ArtifactFetchError, match=r"a message was dropped: chunked message of \d+ bytes exceeds "
                                                     rf"the {MAX_MANIFEST_BYTES + REPLY_OVERHEAD_BYTES}-byte limit"):
            fetch_bundle("cam1", cfg, sha, tmp_path / "bundle", timeout_s=3)
    finally:
        link.stop()


def test_a_replayed_chunk_of_another_message_leaves_the_real_reply_room(broker, tmp_path, bundle):
    """A review's finding: a fetch's reply bound (its file's size) was also its sender's whole
    reassembly budget, so one replayed, genuinely signed chunk of an earlier aggregator message,
    held until its TTL, left the real reply no room on every try and the fetch timed out. A sender
    may hold one reply's size per partial-message slot now."""
    import hashlib

    from protocols.chunking import split
    from protocols.identity import DeviceIdentity, sender_verifier
    from protocols.mqtt_link import MqttLink
    from protocols.payloads.artifacts import GET, artifact_message
    from protocols.topics import AGGREGATOR_ID

    topics, cfg = Topics(), BrokerConfig.from_url(broker.url)
    aggregator = DeviceIdentity.generate(AGGREGATOR_ID)
    data = bytes(range(256)) * 2700                                    # 691,200 bytes: three chunks
    file_sha = hashlib.sha256(data).hexdigest()
    manifest = one_file_manifest(bundle, "head.pte", data)
    manifest_sha = hashlib.sha256(manifest).hexdigest()

    def signed_parts(sha: str, name: str, payload: bytes) -> list[bytes]:
        raw = encode(artifact_message(AGGREGATOR_ID, sha, name, payload), signer=aggregator.sign)
        return split(raw, decode(raw).id, AGGREGATOR_ID, signer=aggregator.sign)

    earlier = signed_parts("0" * 64, "model.pte", bytes(600_000))[1]     # captured from an earlier fetch

    def answer(payload: bytes) -> None:
        env = decode(payload)
        if env.type != GET:
            return
        if env.body["sha256"] == manifest_sha:
            parts = signed_parts(manifest_sha, "manifest.json", manifest)
        else:
            parts = [earlier] + signed_parts(file_sha, "head.pte", data)  # the replay lands first
        for part in parts:
            link.publish(topics.inbox("cam1"), part)

    link = MqttLink("replayer-and-aggregator", cfg, on_message=lambda t, p: answer(p),
                    subscriptions=[(topics.outbox("cam1"), 1)])
    link.start(timeout=30)
    try:
        got = fetch_bundle("cam1", cfg, manifest_sha, tmp_path / "bundle", timeout_s=20, retry_s=2,
                           verifier=sender_verifier(AGGREGATOR_ID, aggregator.public_key_bytes))
        assert (got.parent / "head.pte").read_bytes() == data
    finally:
        link.stop()


def test_one_sender_makes_a_fetch_hold_no_more_than_the_files_size(broker, tmp_path, bundle, monkeypatch):
    """A review's finding: a fetch let each sender hold one reply's size per partial-message slot, 4
    of them, so a device without the aggregator's key (which takes chunks from whoever claims to be
    the aggregator) buffered 4x the file for one forger. A forger answering the ask with the first
    chunks of 6 different messages, each as large as a reply may be, now makes the fetch hold at
    most the file's declared size plus the reply's envelope (``REPLY_OVERHEAD_BYTES``), and the real
    reply that follows is still taken whole."""
    import hashlib

    import edge_client.artifacts as artifacts
    from protocols.chunking import split
    from protocols.mqtt_link import MqttLink
    from protocols.payloads.artifacts import GET, artifact_message
    from protocols.topics import AGGREGATOR_ID

    topics, cfg = Topics(), BrokerConfig.from_url(broker.url)
    data = bytes(range(256)) * 2700                                    # 691,200 bytes: three chunks
    file_sha = hashlib.sha256(data).hexdigest()
    manifest = one_file_manifest(bundle, "head.pte", data)
    manifest_sha = hashlib.sha256(manifest).hexdigest()
    bound = len(data) + artifacts.REPLY_OVERHEAD_BYTES

    def parts(sha: str, name: str, payload: bytes) -> list[bytes]:
        raw = encode(artifact_message(AGGREGATOR_ID, sha, name, payload))
        return split(raw, decode(raw).id, AGGREGATOR_ID)

    # each forged message as large as the reply: its first two chunks, never the last
    forged = [part for i in range(6) for part in parts(file_sha, "head.pte", bytes([i]) * len(data))[:2]]
    held: list[int] = []                        # what the fetch's assemblers hold, after every payload

    def watched(*args, **kwargs):
        asm = make_inbox(*args, **kwargs)
        feed = asm.feed
        asm.feed = lambda payload, now=None: _held_after(feed, asm, payload, now)
        return asm

    def _held_after(feed, asm, payload, now):
        try:
            return feed(payload, now)
        finally:
            held.append(asm.reassembler.pending_bytes())

    make_inbox = artifacts.aggregator_inbox
    monkeypatch.setattr(artifacts, "aggregator_inbox", watched)

    def answer(payload: bytes) -> None:
        env = decode(payload)
        if env.type != GET:
            return
        if env.body["sha256"] == manifest_sha:
            out = parts(manifest_sha, "manifest.json", manifest)
        else:
            out = [*forged, *parts(file_sha, "head.pte", data)]        # the forgeries land first
        for part in out:
            link.publish(topics.inbox("cam1"), part)

    link = MqttLink("forger-and-aggregator", cfg, on_message=lambda t, p: answer(p),
                    subscriptions=[(topics.outbox("cam1"), 1)])
    link.start(timeout=30)
    try:
        got = fetch_bundle("cam1", cfg, manifest_sha, tmp_path / "bundle", timeout_s=20, retry_s=10)
        assert (got.parent / "head.pte").read_bytes() == data
    finally:
        link.stop()
    assert len(held) >= len(forged) and max(held) > 0
    assert max(held) <= bound, f"one sender made the fetch hold {max(held)} bytes for a {len(data)}-byte file"
