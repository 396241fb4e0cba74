"""A device that ended between its swap and its report leaving (issue 29: a crash mid-rollout, on the
device's side), over a real mosquitto with the real controller and slot.

The slot's swap is durable before the report is published (QoS 1, held in the MQTT client's memory
until acknowledged), so a device process ended in between comes back running the candidate, under
the sequence of its assignment; the broker's retained assignment is then a re-delivery, on which a
follower (Python or Java) sends nothing. The controller, which never got the report, asks such a
device again when the stage still has too few reports halfway through its patience: a new
sequence, which the device judges and reports. Before, the canary waited out its patience and rolled back for too few
reports, every device running the candidate."""

import hashlib
import subprocess

import pytest

import java_build
from aggregator.storage.deployments import DeploymentStore
from edge_client.deployment import ModelSlot
from ops_fleet import wait_for
from protocols.payloads import deployment as D
from deployment_fleet import D_sha, correct, model_id, store_state
from deployment_fleet import setup, world  # noqa: F401 (fixtures)

CANARY = ["cam-0", "cam-1", "cam-2"]


def crashed_after_swap(store, fleet, device, deployment_id, head) -> int:
    """``device``'s slot as its follower left it when the process ended right after the swap of
    ``deployment_id``'s head, the report not yet out: the real slot's writes, in the follower's
    order (the sequence held, then the head swapped). The sequence of that assignment."""
    wait_for(lambda: device in DeploymentStore(store).last_assignments(), what=f"{device}'s assignment sent")
    seq = DeploymentStore(store).last_assignments()[device][1]
    slot = ModelSlot(fleet.tmp / device)
    slot.bind_key(fleet.key)
    slot.hold_seq(seq)
    data = D.head_npz(*head)
    slot.swap(data, hashlib.sha256(data).hexdigest(), deployment_id)
    return seq


def deploy_canary(ctl, good):
    # patience 16 s: the silent device is asked again at 1 + 8 s and has 8 s to answer, room for a JVM's
    # start and a model's evaluation on a loaded 2-core CI machine (8 s failed there now and then)
    ctl.call(lambda: ctl.deploy(good, cohort="devices:" + ",".join(CANARY), stages="100%", bake_s=1,
                                min_reports=3, patience_s=16, deployment_id="good-1"))


def canary_with_cam0_crashed_after_its_swap(setup, world):
    """The canary deployed, its other devices running, cam-0's slot as a crash after its swap leaves
    it: (store, controller, fleet, the sequence cam-0 holds)."""
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    for d in CANARY[1:]:
        fleet.start(d)
    ctl = controller()
    deploy_canary(ctl, good)
    return store, ctl, fleet, crashed_after_swap(store, fleet, "cam-0", "good-1", world["good"])


def test_a_device_that_ended_before_its_report_left_is_asked_again_not_rolled_back(setup, world):
    store, ctl, fleet, seq = canary_with_cam0_crashed_after_its_swap(setup, world)
    restarted = fleet.start("cam-0")        # the device's process again: its retained assignment re-delivered
    wait_for(lambda: store_state(store, "good-1") != "canary", what="the canary judged")
    view = ctl.show("good-1")
    assert view["history"][1]["to"] == "widening", view["reason"]
    Z, y = world["holdout"]["cam-0"]
    report = view["devices"]["cam-0"]["report"]
    assert report["seq"] > seq and (report["n"], report["correct_candidate"]) == (len(y), correct(world["good"], Z, y))
    assert restarted.slot.current.sha256 == D_sha(world["good"]) and not restarted.refusals


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_a_java_device_that_ended_before_its_report_left_is_asked_again(setup, world, broker, tmp_path):
    """The same on the Java follower, restarted on the slot folder the Python slot wrote (one format)."""
    from test_java_device import write_features

    store, ctl, fleet, seq = canary_with_cam0_crashed_after_its_swap(setup, world)
    Z, y = world["holdout"]["cam-0"]
    cmd = java_build.java_command("-cp", java_build.built(), "FollowerRunner", broker.url, "cam-0",
                                  fleet.topics.root, fleet.key.hex(), str(fleet.tmp / "cam-0"),
                                  str(write_features(tmp_path / "held.bin", Z.astype("float32"), y)))
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        wait_for(lambda: store_state(store, "good-1") != "canary", what="the canary judged")
        view = ctl.show("good-1")
        assert view["history"][1]["to"] == "widening", view["reason"]
        assert view["devices"]["cam-0"]["report"]["seq"] > seq
        out, err = proc.communicate("", timeout=30)
        assert "CURRENT " + D_sha(world["good"]) in out and "REFUSALS 0" in out, (out, err[-2000:])
    finally:
        if proc.poll() is None:
            proc.kill()
