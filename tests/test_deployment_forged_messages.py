"""Forged deployment messages to a device over a real mosquitto: a head altered after signing, one
whose bytes do not hash to its assignment, an assignment whose head never comes are each refused
with their class and reported once, however many forgeries come (and the refusals kept are bounded);
a sequence forged before the device had the aggregator's key does not bind it after."""

import time

import numpy as np

from edge_client.deployment import DeploymentFollower, ModelSlot
from protocols.envelope import Envelope, decode, encode
from protocols.payloads import deployment as D
from ops_fleet import wait_for
from deployment_fleet import Sniffer, D_sha
from deployment_fleet import world  # noqa: F401 (fixture)


def test_a_refusal_names_its_class_and_forgeries_cannot_make_a_device_flood_reports(broker, tmp_path, world):
    """A device holding the aggregator's key, driven by a test-held aggregator identity over the
    broker: a head altered after signing is refused as ``signature``, one whose bytes do not hash
    to the assignment (signed as such) as ``hash``, an assignment whose head never comes as
    ``timeout``, each reported against its own assignment (once per class, however many forged
    heads come); 30 forged assignments make one report."""
    from protocols.identity import DeviceIdentity
    from protocols.mqtt_link import BrokerConfig
    from protocols.payloads.artifacts import artifact_message
    from protocols.topics import AGGREGATOR_ID, Topics

    agg = DeviceIdentity.generate(AGGREGATOR_ID)
    T = Topics(f"r{time.monotonic_ns()}")
    sniffer = Sniffer(broker, [T.deploy_out("cam-0")])
    follower = DeploymentFollower("cam-0", BrokerConfig.from_url(broker.url), ModelSlot(tmp_path / "slot"),
                                  lambda bundle: world["holdout"]["cam-0"], topics=T, aggregator_key=agg.public_key_bytes,
                                  retry_s=0.2, fetch_timeout_s=1.0, refusal_interval_s=60).start()
    head = D.head_npz(*world["good"])
    sha = D_sha(world["good"])

    def assign(dep, seq, sha=sha):
        sniffer.publish(T.deploy("cam-0"), encode(D.run_message(AGGREGATOR_ID, dep, sha, len(head), 1, device="cam-0",
                                                                seq=seq), signer=agg.sign), retain=True)

    def reports():
        return [decode(p).body for p in sniffer.seen.get(T.deploy_out("cam-0"), []) if decode(p).type == D.REPORT]
    try:
        assign("d1", 1)                          # the head, altered after the aggregator signed it
        wait_for(lambda: T.deploy_out("cam-0") in sniffer.seen, what="the head asked for")
        signed = bytearray(encode(artifact_message(AGGREGATOR_ID, sha, "d1.npz", head), signer=agg.sign))
        signed[len(signed) // 2] ^= 1
        for _ in range(5):                       # refused each time, reported once for the assignment
            sniffer.publish(T.deploy_in("cam-0"), bytes(signed))
        wait_for(lambda: len(follower.refusals) == 5, what="the five signature refusals")
        time.sleep(0.2)
        assert len(reports()) == 1
        assign("d2", 2)                          # a signed head whose bytes are not the assigned ones
        wait_for(lambda: follower._pending is not None, what="d2 pending")
        other = D.head_npz(*world["broken"])
        sniffer.publish(T.deploy_in("cam-0"), encode(artifact_message(AGGREGATOR_ID, sha, "d2.npz", other),
                                                     signer=agg.sign))
        wait_for(lambda: len(reports()) == 2, what="the hash refusal")
        assign("d3", 3)                          # nobody answers
        wait_for(lambda: len(reports()) == 3, what="the timeout refusal")
        got = [(r["deployment"], r["seq"], r["reason"]) for r in reports()]
        assert got == [("d1", 1, "signature"), ("d2", 2, "hash"), ("d3", 3, "timeout")], got
        assert follower.slot.current is None

        assign("d4", 4)                          # now a head is taken, then forgeries rain
        sniffer.publish(T.deploy_in("cam-0"), encode(artifact_message(AGGREGATOR_ID, sha, "d4.npz", head),
                                                     signer=agg.sign))
        wait_for(lambda: follower.slot.current is not None, what="the d4 swap")
        # the swap's own report (no "refused") may still be on its way: count from after it
        wait_for(lambda: any(r["deployment"] == "d4" and "refused" not in r for r in reports()), what="the d4 report")
        before, refusals = len(reports()), len(follower.refusals)
        for i in range(30):
            sniffer.publish(T.deploy("cam-0"), encode(D.run_message(AGGREGATOR_ID, f"x{i}", sha, len(head), 1,
                                                                    device="cam-0", seq=100 + i)), retain=True)
        wait_for(lambda: len(follower.refusals) == refusals + 30, what="thirty refusals")
        time.sleep(0.3)
        flood = reports()[before:]
        assert [(r["deployment"], r["seq"], r["reason"]) for r in flood] == [("d4", 4, "signature")], flood
        # a review's finding: every refusal was kept whole for the process's life (a schema error
        # quotes the field: 60 KB a forged message here); the latest few are kept, each cut
        from edge_client.deployment import KEPT_REFUSALS, MAX_WHY_CHARS
        junk = encode(Envelope(type="x" * 60_000, sender=AGGREGATOR_ID, body={}))
        for _ in range(KEPT_REFUSALS + 20):
            sniffer.client.publish(T.deploy("cam-0"), junk, qos=1)
        wait_for(lambda: sum("x" * 100 in r for r in follower.refusals) == KEPT_REFUSALS, timeout=30,
                 what="the junk refused")
        assert len(follower.refusals) == KEPT_REFUSALS and max(map(len, follower.refusals)) <= MAX_WHY_CHARS
    finally:
        sniffer.publish(T.deploy("cam-0"), b"", retain=True)
        follower.stop()
        sniffer.close()


def test_a_sequence_forged_before_the_device_had_the_key_does_not_bind_it_after(broker, tmp_path):
    """A review's finding: a device following rollouts without the aggregator's key (an open
    broker) took an unsigned assignment of seq 2^62 - 1 and kept that sequence; once given the key
    it refused every signed assignment as older, for good. A sequence binds only under the key it
    was held under (``ModelSlot.bind_key``); one written before keys were recorded keeps binding."""
    from protocols.identity import DeviceIdentity
    from protocols.mqtt_link import BrokerConfig
    from protocols.topics import Topics

    topics, cfg = Topics(), BrokerConfig.from_url(broker.url)
    aggregator = DeviceIdentity.generate("aggregator")
    holdout = lambda sha: (np.zeros((4, 3)), np.zeros(4, int))     # noqa: E731
    raw = Sniffer(broker, [])
    try:
        open_follower = DeploymentFollower("dev1", cfg, ModelSlot(tmp_path / "slot"), holdout, topics,
                                           client_id="dev1.a").start()
        forged = D.rollback_message("aggregator", "x", "forged", device="dev1", seq=2**62 - 1)
        raw.publish(topics.deploy("dev1"), encode(forged), retain=True)          # unsigned, retained
        wait_for(lambda: ModelSlot(tmp_path / "slot").seq == 2**62 - 1, what="the forged sequence held")
        open_follower.stop()
        raw.publish(topics.deploy("dev1"), b"", retain=True)
        keyed = DeploymentFollower("dev1", cfg, ModelSlot(tmp_path / "slot"), holdout, topics,
                                   aggregator_key=aggregator.public_key_bytes, client_id="dev1.b").start()
        assert keyed.slot.seq == 0
        real = D.run_message("aggregator", "dep-1", "ab" * 32, 100, 1, device="dev1", seq=1)
        raw.publish(topics.deploy("dev1"), encode(real, signer=aggregator.sign), retain=True)
        wait_for(lambda: keyed.slot.seq == 1, what="the signed assignment taken")
        assert not any("older than the one held" in r for r in keyed.refusals), keyed.refusals
        keyed.stop()
        # under the same key the held sequence still binds: an older signed one is refused
        again = DeploymentFollower("dev1", cfg, ModelSlot(tmp_path / "slot"), holdout, topics,
                                   aggregator_key=aggregator.public_key_bytes, client_id="dev1.c")
        assert again.slot.seq == 1
    finally:
        raw.publish(topics.deploy("dev1"), b"", retain=True)
        raw.close()
