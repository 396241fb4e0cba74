"""A ``tags:`` canary over a real mosquitto: it holds the devices the operator tagged, never those
announcing the tag (and a cohort naming devices not in the fleet is refused); a device untagged
mid-canary goes back to the settled version and returns with its tag, judged anew (its old report
dropped, also when it missed its rollback while offline)."""

import time

import pytest

from protocols.payloads import deployment as D
from ops_fleet import wait_for
from deployment_fleet import forget_session, model_id, settle, settled_on_v1, tagged_canary, two_versions
from deployment_fleet import setup, world  # noqa: F401 (fixtures)


def test_a_tags_canary_holds_the_devices_the_operator_tagged_never_those_announcing_the_tag(setup, world):
    """A review's finding: a tags: cohort read the tags each device announces in its own profile, so
    any enrolled device could put itself in a canary (and enough of them outvote its honest devices).
    It reads the tags the operator gave (POST /api/devices/{id}/tags) now; a profile's are shown only."""
    store, controller, fleet = setup
    store.device_seen("cam-1", profile={"tags": "lab"})         # what a presence announcing the tag stores
    store.set_device_tags("cam-0", ["lab", "north"])
    store.set_device_tags("cam-2", ["north"])
    with pytest.raises(KeyError):
        store.set_device_tags("cam-404", ["lab"])
    good = model_id(store, "good", *world["good"])
    ctl = controller()
    with pytest.raises(ValueError, match="no device carries these tags"):      # a typo, or tags never given
        ctl.call(lambda: ctl.deploy(good, cohort="tags:lbs", stages="100%", bake_s=3600, deployment_id="typo"))
    # a devices: list naming one not in the fleet (a review's finding: the typo was dropped, and a list of
    # none rolled back at once, its id used up) is refused, nothing made
    for cohort, named in (("devices:cam-0,cam-typo", "cam-typo"), ("devices:ghost1,ghost2", "ghost1, ghost2")):
        with pytest.raises(ValueError, match=f"not in the fleet \\(unknown or revoked\\): {named}$"):
            ctl.call(lambda: ctl.deploy(good, cohort=cohort, stages="100%", bake_s=3600, deployment_id="lab"))
    ctl.call(lambda: ctl.deploy(good, cohort="tags:lab", stages="100%", bake_s=3600, deployment_id="lab"))
    wait_for(lambda: ctl.call(lambda: sorted(ctl.active.sent)) == ["cam-0"], what="the canary assigned")
    assert store.device("cam-1")["tags"] == [] and store.device("cam-0")["tags"] == ["lab", "north"]
    store.set_device_tags("cam-0", [])                           # cleared
    assert store.device("cam-0")["tags"] == [] and store.device("cam-2")["tags"] == ["north"]


def test_a_device_untagged_mid_canary_goes_back_to_the_settled_version_and_returns_with_its_tag(setup, world):
    """A device the operator takes out of a ``tags:`` canary (its tag removed) ran the candidate on
    until promotion or rollback, its reports no longer counted. The candidate is rolled back on it now
    (it goes back to what it kept: nothing here, the settled version below), the settled version's run
    follows, and it gets the candidate again when it is tagged again. A later rollback of the settled
    version takes it where it takes the others, never back to the candidate (a review's finding)."""
    store, controller, fleet = setup
    (v1, v2), (sha1, sha2) = two_versions(store, world)
    for d in ("cam-0", "cam-1"):
        fleet.start(d)
    ctl = controller()
    tagged_canary(ctl, store, fleet, v2, sha2, "first")
    store.set_device_tags("cam-0", [])                                  # no settled version: rolled back
    wait_for(lambda: fleet.sha("cam-0") is None, what="the first candidate rolled back on the untagged device")
    assert ctl.call(lambda: ctl.active.sent["cam-0"])["sent"] == "rollback" and ctl.show("first")["state"] == "canary"
    ctl.call(lambda: ctl.rollback("first"))

    settle(ctl, store, fleet, v1, sha1)
    tagged_canary(ctl, store, fleet, v2, sha2)
    store.set_device_tags("cam-0", [])
    wait_for(lambda: fleet.sha("cam-0") == sha1 and ctl.last["cam-0"][0] == "v1",
             what="the settled version back on the untagged device, and its run sent")
    assert ctl.show("v2")["devices"]["cam-0"]["sent"] == "rollback" and ctl.show("v2")["state"] == "canary"
    assert fleet.sha("cam-1") == sha1
    old_report = ctl.show("v2")["devices"]["cam-0"]["report"]
    store.set_device_tags("cam-0", ["lab"])                             # back in the canary: the candidate again
    wait_for(lambda: ctl.last["cam-0"][0] == "v2", what="the candidate sent again to the device tagged again")
    wait_for(lambda: fleet.sha("cam-0") == sha2 and ctl.show("v2")["devices"]["cam-0"]["report"] not in (None, old_report),
             what="the candidate judged anew on the device tagged again (its old report gone)")
    store.set_device_tags("cam-0", [])
    wait_for(lambda: fleet.sha("cam-0") == sha1 and ctl.last["cam-0"][0] == "v1", what="let go again")
    ctl.call(lambda: ctl.rollback("v1"))                                # the settled version rolled back
    wait_for(lambda: fleet.sha("cam-1") is None, what="v1 rolled back on the device that never left it")
    time.sleep(1.0)                                                     # ticks enough to send anything else
    assert fleet.sha("cam-0") is None, "the device let go runs the candidate again, unjudged"


def test_a_run_sent_again_after_a_rollback_drops_the_devices_old_report(tmp_path):
    """A review's finding: a device let go by a canary (rolled back on it) and later back in its stage
    kept its old report, which counted in the guard before the device judged the head again. A run
    after a rollback clears it, durably and in the controller's memory; a rollback keeps it (the
    rolled-back deployment's record), and a run re-sent to a device that runs it keeps it too."""
    from aggregator.storage.deployments import DeploymentStore
    from aggregator.storage.store import Store

    store = Store(tmp_path / "state.db")
    table = DeploymentStore(store)
    table.create("dep", 1, "canary", {})
    report = {"deployment": "dep", "n": 40}
    table.mark_sent("dep", ["cam-0"], D.RUN)
    table.record_report("dep", "cam-0", report)
    table.mark_sent("dep", ["cam-0"], D.RUN)                     # re-sent while it runs: kept
    assert table.devices("dep")["cam-0"]["report"] == report
    table.mark_sent("dep", ["cam-0"], D.ROLLBACK)                # let go: the record keeps it
    assert table.devices("dep")["cam-0"]["report"] == report
    table.mark_sent("dep", ["cam-0"], D.RUN)                     # back in the stage: judged anew
    assert table.devices("dep")["cam-0"] == {**table.devices("dep")["cam-0"], "sent": D.RUN, "report": None}


def test_a_device_that_missed_its_rollback_judges_the_candidate_again_when_it_is_sent_anew(setup, world, broker):
    """A review's finding: a device let go by a ``tags:`` canary while offline, and tagged again,
    whose broker session was lost meanwhile (past its expiry, a broker without persistence) gets only
    the retained run of the candidate it still runs. It took that as a re-delivery and said nothing,
    while the controller had dropped its old report (a run after a rollback is judged anew): it ran
    the candidate outside the guard for good. A run of the head it runs under a new sequence is
    judged again and reported, on both devices (the Java follower's rule is the same)."""
    store, controller, fleet = setup
    ctl, (v1, v2), (sha1, sha2) = settled_on_v1(setup, world)
    tagged_canary(ctl, store, fleet, v2, sha2)
    fleet.followers["cam-0"].stop()                             # offline
    store.set_device_tags("cam-0", [])
    wait_for(lambda: ctl.show("v2")["devices"]["cam-0"]["sent"] == "rollback", what="let go while offline")
    store.set_device_tags("cam-0", ["lab"])
    wait_for(lambda: ctl.show("v2")["devices"]["cam-0"]["sent"] == "run" and
             ctl.show("v2")["devices"]["cam-0"]["report"] is None, what="the candidate sent anew, to be judged anew")
    forget_session(broker, "cam-0")     # only the retained run reaches it, not the rollback queued for it
    fleet.start("cam-0")
    wait_for(lambda: ctl.show("v2")["devices"]["cam-0"]["report"] is not None, timeout=30,
             what="the device running the candidate reports on it again")
    assert fleet.sha("cam-0") == sha2
