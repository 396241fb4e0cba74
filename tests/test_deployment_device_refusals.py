"""What a device following rollouts over a real mosquitto refuses, saying why while it keeps running
its version: an unsigned assignment (when it holds the aggregator's key), a tampered head, a kept
head whose file is gone (or a FIFO), an assignment its slot cannot write; and what it does not
refuse: a passing failure to read its held-out features is tried again."""

import hashlib
import os
import re
import time

import paho.mqtt.client as mqtt
import pytest

from edge_client.deployment import DeploymentFollower, ModelSlot
from protocols.envelope import encode
from protocols.mqtt_link import BrokerConfig
from protocols.payloads import deployment as D
from protocols.payloads.artifacts import artifact_message
from protocols.topics import AGGREGATOR_ID
from ops_fleet import wait_for
from deployment_fleet import D_sha, correct, model_id, store_state
from deployment_fleet import setup, world  # noqa: F401 (fixtures)


def test_unsigned_assignments_and_tampered_heads_are_refused_and_the_device_keeps_its_version(setup, world, broker):
    store, controller, fleet = setup
    T = fleet.topics
    good = model_id(store, "good", *world["good"])
    ctl = controller()
    for d in ("cam-0", "cam-1"):
        fleet.start(d)
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0,cam-1", stages="100%", bake_s=0.1, min_reports=2,
                                deployment_id="good-1"))
    good_sha = D_sha(world["good"])
    wait_for(lambda: fleet.sha("cam-0") == good_sha and fleet.sha("cam-1") == good_sha, what="the swap")

    raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="intruder")
    raw.connect("127.0.0.1", broker.port)
    raw.loop_start()
    try:
        evil = D.head_npz(*world["broken"])
        sha = hashlib.sha256(evil).hexdigest()
        # unsigned, on a device holding the aggregator's key: refused before anything is fetched
        raw.publish(T.deploy("cam-0"), encode(D.run_message(AGGREGATOR_ID, "evil", sha, len(evil), 1,
                                                                     device="cam-0", seq=2 ** 61)),
                    qos=1, retain=True).wait_for_publish(5)
        wait_for(lambda: fleet.followers["cam-0"].refusals, what="the unsigned assignment's refusal")
        assert "unsigned" in fleet.followers["cam-0"].refusals[-1] or "signature" in fleet.followers["cam-0"].refusals[-1]
        assert fleet.sha("cam-0") == good_sha

        # a device without the key (and unknown to the controller) takes the assignment, but a head
        # that does not hash to it is refused
        trusting = DeploymentFollower("stranger", BrokerConfig.from_url(broker.url), ModelSlot(fleet.tmp / "stranger"),
                                      lambda bundle: world["holdout"]["cam-5"], topics=T, retry_s=0.3,
                                      fetch_timeout_s=10).start()
        fleet.followers["stranger"] = trusting
        asked = []
        raw.on_message = lambda c, u, m: asked.append(m.topic)
        raw.subscribe(T.deploy_out("stranger"), qos=1)
        raw.publish(T.deploy("stranger"), encode(D.run_message(AGGREGATOR_ID, "evil", sha, len(evil), 1,
                                                                       device="stranger", seq=1)),
                    qos=1, retain=True).wait_for_publish(5)
        wait_for(lambda: asked, what="the device to ask for the head")
        tampered = evil[:-1] + bytes([evil[-1] ^ 1])
        raw.publish(T.deploy_in("stranger"), encode(artifact_message(AGGREGATOR_ID, sha, "evil.npz", tampered)),
                    qos=1).wait_for_publish(5)
        wait_for(lambda: trusting.refusals, what="the tampered head's refusal")
        assert "differs from the requested" in trusting.refusals[-1] and trusting.slot.current is None
        assert trusting.reports[-1]["refused"] == trusting.refusals[-1]
    finally:
        raw.publish(T.deploy("cam-0"), b"", retain=True).wait_for_publish(5)
        raw.publish(T.deploy("stranger"), b"", retain=True).wait_for_publish(5)
        raw.loop_stop()
        raw.disconnect()


@pytest.mark.parametrize("lost", ["gone", "fifo"])
def test_a_kept_head_whose_file_is_gone_is_refused_with_the_reason_and_the_device_keeps_its_version(setup, world, lost):
    """The device runs v2 and keeps v1's head; v1's file is lost on disk (or, a review's finding, a
    FIFO stands in its place, which the plain read waited on for ever); v1's model deployed again
    (the kept version, read from the slot, not fetched) is refused with why, reported, and the device
    stays on v2 (the read error used to escape the handler: no refusal, no report)."""
    store, controller, fleet = setup
    good, other = model_id(store, "good", *world["good"]), model_id(store, "other", *world["broken"])
    follower = fleet.start("cam-0")
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=0, min_reports=1, deployment_id="v1"))
    wait_for(lambda: store_state(store, "v1") == "complete", what="v1")
    ctl.call(lambda: ctl.deploy(other, cohort="devices:cam-0", stages="100%", bake_s=3600, deployment_id="v2"))
    ctl.call(lambda: ctl.promote("v2"))
    ctl.call(lambda: ctl.promote("v2"))
    wait_for(lambda: fleet.sha("cam-0") == D_sha(world["broken"]), what="v2")
    (follower.slot.dir / f"{D_sha(world['good'])}.npz").unlink()
    if lost == "fifo":
        os.mkfifo(follower.slot.dir / f"{D_sha(world['good'])}.npz")
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=3600, min_reports=1,
                                deployment_id="v3"))
    wait_for(lambda: follower.refusals, what="the refusal")
    assert follower.refusals[-1].startswith("kept head unreadable, staying on the current version")
    wait_for(lambda: ctl.show("v3")["counts"].get("refused:load") == 1, what="the refusal reported")
    assert fleet.sha("cam-0") == D_sha(world["broken"])


def test_an_assignment_the_slot_cannot_write_is_refused_and_reported(setup, world):
    """A review's finding: when the slot could not record an assignment's sequence (disk full, a
    read-only folder: here a directory stands where slot.json is renamed to), the Python follower's
    error escaped to its loop's log as a traceback, where the Java follower refuses it (and reports
    the refusal against the version it runs, as every refusal of no assignment being acted on).
    Nothing is acted on: the assignment's sequence is not durable."""
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    follower = fleet.start("cam-0")
    ctl = controller()
    state = follower.slot.dir / "slot.json"
    if state.exists():
        state.unlink()
    state.mkdir()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=3600, min_reports=1,
                                deployment_id="v1"))
    wait_for(lambda: follower.refusals, what="the refusal")
    assert re.match(r"assignment \d+ not written: .*slot\.json.* is not a regular file", follower.refusals[-1])
    assert follower.slot.current is None and follower.loop.alive           # nothing acted on; the follower goes on


class FlakyHoldout:
    """The application's held-out features, failing its first ``failures`` reads (a disk busy, a
    store being rotated) and then giving the device's split."""

    def __init__(self, features, failures, error=OSError):
        self.features, self.failures, self.reads, self.error = features, failures, 0, error

    def __call__(self, bundle):
        self.reads += 1
        if self.reads <= self.failures:
            raise self.error(f"held-out store unavailable (read {self.reads})")
        return self.features


class ApplicationStop(BaseException):
    """An application's own BaseException (not an Exception)."""


def test_a_passing_failure_of_the_devices_features_is_tried_again_not_reported_as_a_refusal(setup, world):
    """The device tries the held head again every retry_s: the rollout sees its counts, no refusal,
    and a guard of ``refused<=0`` completes. One whose features never come back refuses once the
    fetch timeout has passed since the first failure, saying why."""
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    flaky = FlakyHoldout(world["holdout"]["cam-0"], failures=2)
    follower = fleet.start("cam-0", holdout=flaky)
    broken = FlakyHoldout(None, failures=10 ** 9)
    stuck = fleet.start("cam-1", holdout=broken, fetch_timeout_s=1.5)
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=0.1, min_reports=1,
                                guard="refused<=0", deployment_id="good-1"))
    wait_for(lambda: store_state(store, "good-1") == "complete", what="the rollout despite two failed reads")
    Z, y = world["holdout"]["cam-0"]
    assert flaky.reads == 3 and not follower.refusals and fleet.sha("cam-0") == D_sha(world["good"])
    report = follower.reports[-1]
    assert "refused" not in report and (report["n"], report["correct_candidate"]) == (len(y), correct(world["good"], Z, y))
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-1", stages="100%", bake_s=0.1, min_reports=1,
                                deployment_id="good-2"))
    wait_for(lambda: stuck.refusals, what="the refusal after the fetch timeout")
    assert "not adopted within 1.5s" in stuck.refusals[-1] and "held-out store unavailable" in stuck.refusals[-1]
    assert stuck.reports[-1]["reason"] == "load" and stuck.slot.current is None
    assert broken.reads >= 3          # tried again, every retry_s, before refusing
    reads = broken.reads
    time.sleep(1.2)                   # and not after
    assert broken.reads == reads


def test_a_passing_base_exception_of_the_devices_features_is_tried_again_as_any_failure(setup, world):
    """The application's held-out features fail with a BaseException that is no Exception (its own,
    an asyncio CancelledError): that read's failure, tried again every retry_s as an OSError is (the
    Java follower takes an Error the same way), and the rollout completes. It escaped the follower's
    checks to its loop, which logged it and went on with the assignment dropped: no retry, no
    report, the rollout waiting on the device."""
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    flaky = FlakyHoldout(world["holdout"]["cam-0"], failures=2, error=ApplicationStop)
    follower = fleet.start("cam-0", holdout=flaky)
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=0.1, min_reports=1,
                                guard="refused<=0", deployment_id="good-1"))
    wait_for(lambda: store_state(store, "good-1") == "complete", timeout=15, what="the rollout despite two failed reads")
    assert flaky.reads == 3 and not follower.refusals and fleet.sha("cam-0") == D_sha(world["good"])
