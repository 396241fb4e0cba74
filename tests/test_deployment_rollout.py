"""Model rollout over a real mosquitto (issue 29): the deployment controller beside a store, devices
following their retained assignment with :class:`edge_client.deployment.DeploymentFollower` (the
fleet and its controller: tests/deployment_fleet.py).

* promotion reaches every enrolled device, and each device's reported counts are the held-out
  counts computed here with numpy; the application predicts with the deployed head;
* a failing guard (a head with permuted classes) rolls every canary device back to the version
  it kept, and the devices outside the canary never see the candidate;
* an offline device receives the current version when it comes online;
* a restarted controller resumes the same deployment and re-sends nothing; one that went down
  between storing a rollback and publishing it sends it when it starts again;
* the running head deployed anew is judged once, and comes from the new deployment.

The operator's CLI: test_deployment_admin_cli.py; what a device refuses:
test_deployment_device_refusals.py; rollbacks of the settled version: test_deployment_rollbacks.py;
a personalising (OLL) device: test_deployment_oll.py; the slot's writes: test_model_slot_writes.py."""

import time

import numpy as np
import pytest

from edge_client.deployment import ModelSlot
from ops_fleet import wait_for
from deployment_fleet import DEVICES, N_HOLDOUT, D_sha, Sniffer, correct, model_id, store_state
from protocols.payloads import deployment as D
from deployment_fleet import setup, world  # noqa: F401 (fixtures)


def test_promotion_reaches_every_device_and_a_failing_guard_rolls_the_canary_back(setup, world):
    store, controller, fleet = setup
    good, broken = model_id(store, "good", *world["good"]), model_id(store, "broken", *world["broken"])
    for d in DEVICES[:-1]:                       # the last device is offline during the rollout
        fleet.start(d)
    ctl = controller()
    shown = ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0,cam-1", stages="100%", guard="wma_drop<=1.0",
                                        bake_s=0.2, min_reports=2, deployment_id="good-1"))
    assert shown["state"] == "canary" and shown["cohort"] == "devices:cam-0,cam-1"
    wait_for(lambda: store_state(store, "good-1") == "complete", what="the good head's rollout to complete")
    good_sha = D_sha(world["good"])
    wait_for(lambda: all(fleet.sha(d) == good_sha for d in DEVICES[:-1]), what="every online device to swap")
    wait_for(lambda: ctl.show("good-1")["counts"]["reported"] == len(DEVICES) - 1, what="every online device's report")
    view = ctl.show("good-1")
    assert [h["to"] for h in view["history"]] == ["canary", "widening", "complete"]
    for d in DEVICES[:-1]:                       # counts only, equal to the reference; nothing before: 0
        Z, y = world["holdout"][d]
        assert view["devices"][d]["report"] == {"deployment": "good-1", "seq": ctl.last[d][1], "sha256": good_sha,
                                                "n": N_HOLDOUT,
                                                "correct_candidate": correct(world["good"], Z, y),
                                                "correct_current": 0}
        np.testing.assert_array_equal(fleet.followers[d].slot.predict(Z),
                                      (Z @ np.float32(world["good"][0]).T.astype(float) + world["good"][1]).argmax(1))

    # the offline device comes online: its retained assignment is waiting
    late = fleet.start(DEVICES[-1])
    wait_for(lambda: fleet.sha(DEVICES[-1]) == good_sha, what="the late device to catch up")

    # a broken head (classes permuted): the canary evaluates it, the guard fails, the canary goes back
    ctl.call(lambda: ctl.deploy(broken, cohort="devices:cam-2,cam-3", stages="50%,100%", bake_s=0.2, min_reports=2,
                                deployment_id="broken-1"))
    wait_for(lambda: store_state(store, "broken-1") == "rolled_back", what="the broken head's rollback")
    wait_for(lambda: all(fleet.sha(d) == good_sha for d in DEVICES), what="the canary back on the good head")
    view = ctl.show("broken-1")
    assert "guard median_drop<=1.0 failed" in view["reason"], view["reason"]
    assert sorted(view["devices"]) == ["cam-2", "cam-3"] and view["counts"]["sent_rollback"] == 2
    for d in ("cam-2", "cam-3"):
        Z, y = world["holdout"][d]
        rep = view["devices"][d]["report"]
        assert (rep["correct_candidate"], rep["correct_current"]) == (correct(world["broken"], Z, y),
                                                                     correct(world["good"], Z, y))
    for d in set(DEVICES) - {"cam-2", "cam-3"}:  # never sent the candidate
        assert all(r["deployment"] != "broken-1" for r in fleet.followers[d].reports)
    assert late.slot.previous is None and fleet.followers["cam-2"].slot.previous is None


def test_a_restarted_controller_resumes_the_deployment_and_resends_nothing(setup, world):
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    for d in DEVICES:
        fleet.start(d)
    ctl = controller()
    # a long bake: the canary swaps, then the controller goes down mid-rollout
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0,cam-1,cam-2", stages="100%", bake_s=3.0,
                                min_reports=3, deployment_id="good-1"))
    good_sha = D_sha(world["good"])
    wait_for(lambda: all(fleet.sha(d) == good_sha for d in ("cam-0", "cam-1", "cam-2")), what="the canary swap")
    wait_for(lambda: ctl.show("good-1")["counts"]["reported"] == 3, what="the canary's reports stored")
    ctl.stop()
    sent_at = {d: v["sent_at"] for d, v in ctl.show("good-1")["devices"].items()}
    reports = {d: len(f.reports) for d, f in fleet.followers.items()}

    ctl2 = controller()
    assert ctl2.active is not None and ctl2.active.dep.deployment_id == "good-1" and ctl2.active.dep.state == "canary"
    wait_for(lambda: store_state(store, "good-1") == "complete", what="the resumed rollout to complete")
    wait_for(lambda: all(fleet.sha(d) == good_sha for d in DEVICES), what="every device to swap")
    after = ctl2.show("good-1")["devices"]
    assert {d: after[d]["sent_at"] for d in sent_at} == sent_at          # the canary was not sent it again
    assert all(len(fleet.followers[d].reports) == reports[d] for d in sent_at)



class Crash(Exception):
    """The controller's process ends here (what it stored stays stored; nothing after it happens)."""


@pytest.mark.parametrize("down", ["before the rollback is recorded", "before the rollback is published"])
def test_a_controller_down_mid_rollback_sends_the_rollback_when_it_starts_again(setup, world, down):
    """The first deployment of a fleet (no settled version to follow) is rolled back and the
    controller goes down after storing the rolled-back state: before it recorded the devices'
    rollback, or after recording it and before the broker had it (a publish still in the MQTT
    client's memory, or the broker unreachable). Restarted, it must still reach the canary device,
    which goes back to the version it kept (none), as it does when nothing goes down. Before, the
    restart sent nothing (the deployment no longer active, no settled version): the device ran the
    rolled-back candidate for good."""
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    fleet.start("cam-0")
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=3600, deployment_id="c1"))
    wait_for(lambda: fleet.sha("cam-0") == D_sha(world["good"]), what="the canary running the candidate")
    if down == "before the rollback is recorded":
        def mark_sent(deployment_id, devices, sent, recorded=ctl.table.mark_sent):
            if sent == D.ROLLBACK:
                raise Crash(down)
            return recorded(deployment_id, devices, sent)
        ctl.table.mark_sent = mark_sent
    else:
        ctl.link.publish_envelope = lambda *args, **kwargs: 0
    try:
        ctl.call(lambda: ctl.rollback("c1", "withdrawn"))
    except Crash:
        pass
    ctl.stop()
    assert store_state(store, "c1") == "rolled_back" and fleet.sha("cam-0") == D_sha(world["good"])

    ctl2 = controller()
    wait_for(lambda: fleet.sha("cam-0") is None, timeout=15,
             what=f"cam-0 back on the version it kept (the controller's last: {ctl2.last.get('cam-0')})")
    assert ctl2.show("c1")["devices"]["cam-0"]["sent"] == D.ROLLBACK and ctl2.active is None


def test_the_running_head_deployed_anew_is_judged_once_and_comes_from_the_new_deployment(setup, world, broker):
    """A review's finding: the device kept the running head's old deployment name, so every
    re-delivery of the new deployment's retained assignment (each reconnect) judged it on the
    held-out split and reported again, and the new deployment's rollback did not revert it."""
    store, controller, fleet = setup
    W, b = world["good"]
    mid = model_id(store, "g", W, b)
    follower = fleet.start("cam-0")
    sniffer = Sniffer(broker, [fleet.topics.deploy("cam-0")])
    ctl = controller()
    try:
        for name in ("D1", "D2"):
            ctl.call(lambda: ctl.deploy(mid, cohort="devices:cam-0", stages="100%", bake_s=0, min_reports=1,
                                        deployment_id=name))
            wait_for(lambda: store_state(store, name) == "complete", what=name)
        assert follower.slot.current.deployment == "D2" and follower.slot.current.sha256 == D_sha((W, b))
        on_d2 = lambda: [r for r in follower.reports if r["deployment"] == "D2"]
        assert len(on_d2()) == 1
        retained = [p for p in sniffer.seen[fleet.topics.deploy("cam-0")] if b'"D2"' in p][-1]
        for _ in range(3):                                    # its re-deliveries (reconnects)
            sniffer.publish(fleet.topics.deploy("cam-0"), retained)
        time.sleep(0.5)
        assert len(on_d2()) == 1 and ModelSlot(follower.slot.dir).current.deployment == "D2"
    finally:
        sniffer.close()
