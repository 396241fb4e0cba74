"""A rollout to devices that personalise (OLL) over a real mosquitto: each judges and predicts with
the head pruned to its local labels (the reference: numpy here), and local labels the head has no
row for are refused while the device keeps its version."""

import numpy as np
import pytest

from edge_client.deployment import ModelSlot
from ops_fleet import wait_for
from deployment_fleet import C, correct, model_id, store_state
from deployment_fleet import setup, world  # noqa: F401 (fixtures)


def oll_correct(head, Z, y, local_labels):
    """Independent reference for OLL: only the rows of the local classes compete; the argmax's
    row is mapped back to its class id (held-out samples of other classes are always wrong)."""
    W, b = (np.asarray(a, dtype=np.float32).astype(np.float64) for a in head)
    rows = sorted(set(int(c) for c in local_labels))
    pred = np.array(rows)[(Z @ W[rows].T + b[rows]).argmax(1)]
    return int((pred == y).sum()), pred


def test_a_personalising_device_judges_and_predicts_with_the_oll_pruned_head(setup, world):
    store, controller, fleet = setup
    good, broken = model_id(store, "good", *world["good"]), model_id(store, "broken", *world["broken"])
    local = {"cam-0": [2, 0, 2], "cam-1": [1]}         # training labels: OLL keeps classes {0, 2} and {1}
    for d, labels in local.items():
        fleet.start(d, np.array(labels))
    fleet.start("cam-2")                                # does not personalise: the full head
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0,cam-1,cam-2", stages="100%", bake_s=0.1, min_reports=3,
                                deployment_id="good-1"))
    wait_for(lambda: store_state(store, "good-1") == "complete", what="the first head's rollout")
    ctl.call(lambda: ctl.deploy(broken, cohort="devices:cam-0,cam-1,cam-2", stages="100%", bake_s=0.1,
                                min_reports=3, guard="wma_drop<=100", deployment_id="broken-1"))
    wait_for(lambda: ctl.show("broken-1")["counts"]["reported"] == 3, what="the three reports on the second head")
    view = ctl.show("broken-1")
    for d, labels in local.items():
        Z, y = world["holdout"][d]
        good_right, good_pred = oll_correct(world["good"], Z, y, labels)
        broken_right, broken_pred = oll_correct(world["broken"], Z, y, labels)
        assert set(y) - set(labels), "the held-out split must hold classes the device never trained on"
        assert good_right != correct(world["good"], Z, y) or broken_right != correct(world["broken"], Z, y)
        rep = view["devices"][d]["report"]
        assert (rep["correct_candidate"], rep["correct_current"]) == (broken_right, good_right)
        np.testing.assert_array_equal(fleet.followers[d].slot.predict(Z), broken_pred)
        # the application's own slot on the same directory predicts the same way (the labels are kept)
        np.testing.assert_array_equal(ModelSlot(fleet.tmp / d).predict(Z), broken_pred)
    Z, y = world["holdout"]["cam-2"]
    rep = view["devices"]["cam-2"]["report"]
    assert (rep["correct_candidate"], rep["correct_current"]) == (correct(world["broken"], Z, y),
                                                                 correct(world["good"], Z, y))


def test_local_labels_the_head_has_no_row_for_are_refused_and_the_device_keeps_its_version(setup, world):
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    follower = fleet.start("cam-0", np.array([0, C]))        # a class the 3-class head does not have
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=0.1, min_reports=1,
                                deployment_id="good-1"))
    wait_for(lambda: follower.refusals, what="the refusal")
    assert "cannot be loaded" in follower.refusals[-1] and f"[0, {C})" in follower.refusals[-1]
    assert follower.slot.current is None and follower.reports[-1]["refused"] == follower.refusals[-1]
    with pytest.raises(ValueError, match="non-negative integers"):
        ModelSlot(fleet.tmp / "cam-x", np.array([0.5]))
