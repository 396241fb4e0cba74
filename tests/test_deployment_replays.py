"""Rollouts against an attacker on the broker path who replays what it captured (issue 37), over a
real mosquitto with the controller and followers of tests/deployment_fleet.py:

* a validly signed assignment and head of an older version, captured while it rolled out and
  republished after a newer one, are refused (stale sequence) and the device keeps the newer
  version; the same assignment republished on another device's topic is refused (it names its
  device); a late report on the finished deployment is refused and counted, the stored one
  unchanged; the refusals the device reports are counted per deployment by class;
* a device that lost its state and took a replayed assignment, or one let go by a canary that took
  the candidate's replayed run, is sent the fleet's version again;
* re-deliveries of an assignment do not restart its head's fetch."""

import shutil
import time

from edge_client.deployment import DeploymentFollower, ModelSlot
from protocols.envelope import decode, encode
from protocols.payloads import deployment as D
from ops_fleet import wait_for
from deployment_fleet import (Sniffer, D_sha, forget_session, model_id, newer_assignment_ends_an_older_fetch,
                              settled_on_v1, store_state, tagged_canary)
from deployment_fleet import setup, world  # noqa: F401 (fixtures)


def lose_state(fleet, device: str) -> None:
    """``device`` stopped, its deployment state gone (it holds sequence 0 when it starts again)."""
    fleet.followers[device].stop()
    shutil.rmtree(fleet.tmp / device)


def test_a_replayed_older_assignment_and_head_are_refused_and_late_reports_counted(setup, world, broker, caplog):
    store, controller, fleet = setup
    T = fleet.topics
    sniffer = Sniffer(broker, [T.deploy("cam-0"), T.deploy_in("cam-0")])
    try:
        ctl, (v1, v2), (sha1, sha2) = settled_on_v1(setup, world)
        old_assignment = sniffer.seen[T.deploy("cam-0")][-1]
        old_head = next(p for p in sniffer.seen[T.deploy_in("cam-0")] if decode(p).body.get("sha256") == sha1)
        assert D.parse_assignment(decode(old_assignment))["sha256"] == sha1       # what was captured: v1's, signed
        v1_report = ctl.show("v1")["devices"]["cam-0"]["report"]

        ctl.call(lambda: ctl.deploy(v2, cohort="devices:cam-0,cam-1", stages="100%", bake_s=0, min_reports=2,
                                    deployment_id="v2"))
        wait_for(lambda: store_state(store, "v2") == "complete" and fleet.sha("cam-0") == sha2, what="v2 on cam-0")
        wait_for(lambda: fleet.sha("cam-1") == sha2, what="v2 on cam-1")
        follower = fleet.followers["cam-0"]
        refusals = len(follower.refusals)

        # the downgrade: v1's signed assignment and head republished (retained, as the original)
        sniffer.publish(T.deploy("cam-0"), old_assignment, retain=True)
        sniffer.publish(T.deploy_in("cam-0"), old_head)
        wait_for(lambda: len(follower.refusals) > refusals, what="the replay's refusal")
        assert "older than the one held" in follower.refusals[-1], follower.refusals[-1]
        time.sleep(0.5)                          # time enough to fetch and swap, had it been taken (it took 10 ms)
        assert fleet.sha("cam-0") == sha2 and follower.slot.seq == ctl.last["cam-0"][1]
        assert follower.reports[-1]["reason"] == "stale"

        # redirected: cam-0's assignment on cam-1's topic
        other = fleet.followers["cam-1"]
        n_other = len(other.refusals)
        sniffer.publish(T.deploy("cam-1"), old_assignment, retain=True)
        wait_for(lambda: len(other.refusals) > n_other, what="the redirected assignment's refusal")
        assert "is for 'cam-0', not this device" in other.refusals[-1] and fleet.sha("cam-1") == sha2

        # a late report on the finished v1 (what the replay used to produce), sent as the device
        late = D.report_message("cam-0", "v1", sha1, n=40, correct_candidate=40, correct_current=0,
                                seq=v1_report["seq"])
        sniffer.publish(T.deploy_out("cam-0"), encode(late))
        wait_for(lambda: ctl.show("v1")["counts"]["late_reports"] == 1, what="the late report counted")
        assert ctl.show("v1")["devices"]["cam-0"]["report"] == v1_report
        # sent again and again, it adds nothing within the window (a review's finding: one device
        # inflated any deployment's counters as fast as it could send)
        def refused_late() -> int:      # the controller's warning for each late report it refuses
            return sum("report from cam-0 on v1" in r.getMessage() for r in caplog.records)

        seen = refused_late()
        for _ in range(10):
            sniffer.publish(T.deploy_out("cam-0"), encode(late))
        wait_for(lambda: refused_late() >= seen + 10, what="the repeats refused")
        time.sleep(2 * ctl.tick_s)               # a flush of the counters had they been counted
        assert ctl.show("v1")["counts"]["late_reports"] == 1
        # the device's refusals, by class, on the deployment it runs
        # cam-0's and cam-1's refusal reports travel on two devices' topics: either may arrive last
        wait_for(lambda: ctl.show("v2")["counts"].get("refused:stale") == 1, what="the stale refusal counted")
        wait_for(lambda: ctl.show("v2")["counts"].get("refused:device") == 1, what="the device refusal counted")
        assert ctl.show("v2")["state"] == "complete" and ctl.show("v2")["counts"]["refused"] == 0
    finally:
        for d in ("cam-0", "cam-1"):
            sniffer.publish(T.deploy(d), b"", retain=True)
        sniffer.close()


def test_a_device_that_lost_its_state_is_given_its_assignment_again_after_a_replay(setup, world, broker):
    """A device whose deployment state is gone holds sequence 0 and takes any signed assignment
    addressed to it: one captured while a rolled-back deployment ran, republished (retained) on the
    broker path while the device was offline, with its head. Its report on that assignment is not
    about its last one, so the controller sends its current assignment again, under a new sequence,
    and the device goes back to the version the fleet holds."""
    store, controller, fleet = setup
    topics = fleet.topics
    good, broken = model_id(store, "good", *world["good"]), model_id(store, "broken", *world["broken"])
    sniffer = Sniffer(broker, [topics.deploy("cam-0"), topics.deploy_in("cam-0")])
    for d in ("cam-0", "cam-1", "cam-2"):
        fleet.start(d)
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0,cam-1,cam-2", stages="100%", bake_s=0, deployment_id="g"))
    wait_for(lambda: store_state(store, "g") == "complete", what="g")
    ctl.call(lambda: ctl.deploy(broken, cohort="devices:cam-0,cam-1,cam-2", stages="100%", bake_s=0.2,
                                deployment_id="bad"))
    wait_for(lambda: store_state(store, "bad") == "rolled_back", what="the guard rolls back bad")
    wait_for(lambda: fleet.sha("cam-0") == D_sha(world["good"]), what="cam-0 back on good")
    run_bad, head_bad = sniffer.run(topics, "cam-0", "bad"), sniffer.head(topics, "cam-0", "bad")
    lose_state(fleet, "cam-0")
    sniffer.publish(topics.deploy("cam-0"), run_bad, retain=True)
    fleet.start("cam-0")
    time.sleep(0.5)
    sniffer.publish(topics.deploy_in("cam-0"), head_bad)
    try:
        wait_for(lambda: fleet.sha("cam-0") == D_sha(world["good"]), timeout=30,
                 what=f"cam-0 on the fleet's version again (the controller's last: {ctl.last['cam-0']})")
    finally:
        sniffer.close()


def test_a_re_delivered_assignment_does_not_restart_its_heads_fetch(broker, tmp_path, world):
    """A review's finding: each re-delivery of the retained assignment whose head was being fetched
    started the fetch's clock again, so a replay every few seconds kept the timeout refusal from
    ever being said (and the device asked the aggregator again each time)."""
    from protocols.identity import DeviceIdentity
    from protocols.mqtt_link import BrokerConfig
    from protocols.topics import AGGREGATOR_ID, Topics

    agg = DeviceIdentity.generate(AGGREGATOR_ID)
    T = Topics(f"r{time.monotonic_ns()}")
    sniffer = Sniffer(broker, [T.deploy_out("cam-0")])
    follower = DeploymentFollower("cam-0", BrokerConfig.from_url(broker.url), ModelSlot(tmp_path / "slot"),
                                  lambda bundle: world["holdout"]["cam-0"], topics=T, aggregator_key=agg.public_key_bytes,
                                  retry_s=0.2, fetch_timeout_s=1.5).start()
    head = D.head_npz(*world["good"])
    signed = encode(D.run_message(AGGREGATOR_ID, "d1", D_sha(world["good"]), len(head), 1, device="cam-0", seq=1),
                    signer=agg.sign)
    try:
        start = time.monotonic()
        while time.monotonic() - start < 4.0 and not any(r.get("reason") == "timeout" for r in follower.reports):
            sniffer.publish(T.deploy("cam-0"), signed)          # nobody sends the head; the assignment comes again
            time.sleep(0.3)
        assert [r["reason"] for r in follower.reports] == ["timeout"], follower.reports
        assert time.monotonic() - start < 3.0                     # within its 1.5 s, not restarted by each copy
    finally:
        follower.stop()
        sniffer.close()


def test_a_device_let_go_by_a_canary_that_takes_a_replayed_candidate_is_sent_the_settled_version(setup, world,
                                                                                              broker):
    """A review's finding: a device let go by a ``tags:`` canary (untagged) that lost its state and
    its broker session, then took the candidate's run replayed to it, reported on an assignment not
    its last, and the controller sent it nothing (it was in the canary's record): it stayed on the
    candidate, unjudged. It is sent the settled version's run again, as a device outside the canary is."""
    store, controller, fleet = setup
    topics = fleet.topics
    sniffer = Sniffer(broker, [topics.deploy("cam-0"), topics.deploy_in("cam-0")])
    try:
        ctl, (v1, v2), (sha1, sha2) = settled_on_v1(setup, world)
        tagged_canary(ctl, store, fleet, v2, sha2)
        run_v2, head_v2 = sniffer.run(topics, "cam-0", "v2"), sniffer.head(topics, "cam-0", "v2")
        store.set_device_tags("cam-0", [])
        wait_for(lambda: fleet.sha("cam-0") == sha1 and ctl.last["cam-0"][0] == "v1", what="let go: v1 again")
        lose_state(fleet, "cam-0")
        forget_session(broker, "cam-0")
        sniffer.publish(topics.deploy("cam-0"), run_v2, retain=True)
        fleet.start("cam-0")
        wait_for(lambda: fleet.followers["cam-0"]._pending is not None, what="the replayed run taken")
        sniffer.publish(topics.deploy_in("cam-0"), head_v2)
        wait_for(lambda: ctl.show("v2")["counts"].get("late_reports"), what="its report on the replay refused")
        wait_for(lambda: fleet.sha("cam-0") == sha1, timeout=30,
                 what=f"cam-0 on the settled version again (the controller's last: {ctl.last['cam-0']})")
    finally:
        sniffer.close()



def test_a_newer_assignment_ends_the_fetch_of_an_older_ones_head(broker, tmp_path, world):
    """deployment_fleet.newer_assignment_ends_an_older_fetch on the Python follower (the Java one:
    tests/test_java_deployment.py). Before, the fetch ran on, and the head of the rolled-back
    candidate arriving late became the running version."""
    from protocols.identity import DeviceIdentity
    from protocols.mqtt_link import BrokerConfig
    from protocols.topics import AGGREGATOR_ID, Topics

    agg = DeviceIdentity.generate(AGGREGATOR_ID)
    T = Topics(f"r{time.monotonic_ns()}")
    follower = DeploymentFollower("cam-0", BrokerConfig.from_url(broker.url), ModelSlot(tmp_path / "slot"),
                                  lambda bundle: world["holdout"]["cam-0"], topics=T, aggregator_key=agg.public_key_bytes,
                                  retry_s=0.2, fetch_timeout_s=30).start()
    try:
        newer_assignment_ends_an_older_fetch(broker, agg, T, "cam-0", tmp_path / "slot", world["good"],
                                             world["broken"], retry_s=0.2)
    finally:
        follower.stop()
