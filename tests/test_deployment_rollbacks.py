"""Rolling back over a real mosquitto: the settled version's rollback brings back the one before on
every device (and on a device enrolled afterwards), during a canary it leaves the canary on the
candidate, and two rollbacks in a row leave no device without a head."""

import time

from ops_fleet import wait_for
from deployment_fleet import DEVICES, D_sha, model_id, store_state
from deployment_fleet import setup, world  # noqa: F401 (fixtures)


def test_rolling_back_the_settled_version_brings_back_the_one_before_for_every_device(setup, world):
    store, controller, fleet = setup
    good, other = model_id(store, "good", *world["good"]), model_id(store, "other", *world["broken"])
    devices = DEVICES[:3]
    for d in devices:
        fleet.start(d)
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=0, min_reports=1, deployment_id="v1"))
    good_sha, other_sha = D_sha(world["good"]), D_sha(world["broken"])
    wait_for(lambda: all(fleet.sha(d) == good_sha for d in devices), what="v1 everywhere")
    # the operator pushes v2 through without waiting for its guard, then takes it back
    ctl.call(lambda: ctl.deploy(other, cohort="devices:cam-0", stages="100%", bake_s=3600, deployment_id="v2"))
    ctl.call(lambda: ctl.promote("v2"))
    assert ctl.call(lambda: ctl.promote("v2"))["state"] == "complete"
    wait_for(lambda: all(fleet.sha(d) == other_sha for d in devices), what="v2 everywhere")
    assert ctl.call(lambda: ctl.rollback("v2", "wrong labels"))["state"] == "rolled_back"
    wait_for(lambda: all(fleet.sha(d) == good_sha for d in devices), what="v1 again everywhere")
    # a device enrolled afterwards gets v1, the settled version again
    store.enroll_device("cam-9", None, None)
    fleet.start("cam-9")
    wait_for(lambda: fleet.sha("cam-9") == good_sha, what="the new device on v1")
    assert ctl.show("v2")["replaces"] == good and ctl.show("v2")["reason"] == "wrong labels"


def _three_versions(setup, world):
    """Z, then A complete on cam-0..2 (A: the same predictions as Z, other bytes); B: a broken head."""
    store, controller, fleet = setup
    W, b = world["good"]
    z, a = model_id(store, "z", W, b), model_id(store, "a", W * 1.5, b * 1.5)
    broken = model_id(store, "b", *world["broken"])
    shas = {"z": D_sha((W, b)), "a": D_sha((W * 1.5, b * 1.5)), "b": D_sha(world["broken"])}
    for d in ("cam-0", "cam-1", "cam-2"):
        fleet.start(d)
    ctl = controller()
    for mid, name in ((z, "Z"), (a, "A")):
        ctl.call(lambda: ctl.deploy(mid, cohort="devices:cam-0,cam-1,cam-2", stages="100%", bake_s=0,
                                    deployment_id=name))
        wait_for(lambda: store_state(store, name) == "complete", what=name)
    wait_for(lambda: all(fleet.sha(d) == shas["a"] for d in ("cam-0", "cam-1", "cam-2")), what="A everywhere")
    return store, ctl, fleet, broken, shas


def _running(fleet, shas) -> dict:
    return {d: next((name for name, sha in shas.items() if sha == fleet.sha(d)), None) for d in ("cam-0", "cam-1", "cam-2")}


def test_rolling_back_the_settled_version_during_a_canary_then_the_canary_leaves_every_device_on_the_one_before(
        setup, world):
    """A device keeps one version to go back to: the canary device, reverting B, went back to A,
    which the operator had withdrawn meanwhile. The settled version's run is sent to every device
    a rollback touched, so it holds what the controller says it holds."""
    store, ctl, fleet, broken, shas = _three_versions(setup, world)
    ctl.call(lambda: ctl.deploy(broken, cohort="devices:cam-0", stages="100%", bake_s=3600, deployment_id="B"))
    wait_for(lambda: fleet.sha("cam-0") == shas["b"], what="cam-0 on B")
    ctl.call(lambda: ctl.rollback("A", "A is withdrawn"))
    wait_for(lambda: fleet.sha("cam-1") == shas["z"] and fleet.sha("cam-2") == shas["z"], what="Z on cam-1, cam-2")
    ctl.call(lambda: ctl.rollback("B", "B is bad too"))
    wait_for(lambda: _running(fleet, shas) == {"cam-0": "z", "cam-1": "z", "cam-2": "z"}, timeout=30,
             what=f"Z everywhere (the controller's settled: {ctl.settled.dep.deployment_id})")


def test_rolling_back_the_settled_version_leaves_the_canary_running_the_candidate(setup, world):
    """A review's finding: the settled version's rollback was sent to every device it had run on,
    its canary devices included, so the retained rollback replaced their run of the candidate: a
    device offline meanwhile never ran it, and the others' reports on it were refused as late."""
    store, ctl, fleet, broken, shas = _three_versions(setup, world)
    ctl.call(lambda: ctl.deploy(broken, cohort="devices:cam-0", stages="100%", bake_s=3600, deployment_id="B"))
    wait_for(lambda: fleet.sha("cam-0") == shas["b"], what="cam-0 on B")
    ctl.call(lambda: ctl.rollback("A", "A is withdrawn"))
    wait_for(lambda: fleet.sha("cam-1") == shas["z"] and fleet.sha("cam-2") == shas["z"], what="Z on cam-1, cam-2")
    time.sleep(1.0)                                   # what cam-0 would have been told is out by now
    assert fleet.sha("cam-0") == shas["b"] and ctl.call(lambda: ctl.last["cam-0"][0]) == "B"
    view = ctl.call(lambda: ctl.show("B"))
    assert view["state"] == "canary" and not view["counts"].get("late_reports"), view["counts"]


def test_two_rollbacks_in_a_row_leave_no_device_without_a_head(setup, world):
    store, ctl, fleet, broken, shas = _three_versions(setup, world)
    ctl.call(lambda: ctl.deploy(broken, cohort="devices:cam-0", stages="100%", bake_s=0, min_reports=1,
                                deployment_id="B"))
    wait_for(lambda: store_state(store, "B") == "rolled_back", what="the guard rolls B back")
    wait_for(lambda: fleet.sha("cam-0") == shas["a"], what="cam-0 back on A")
    ctl.call(lambda: ctl.rollback("A", "A is withdrawn"))
    wait_for(lambda: _running(fleet, shas) == {"cam-0": "z", "cam-1": "z", "cam-2": "z"}, timeout=30,
             what="Z everywhere")
