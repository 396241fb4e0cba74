"""A stored head altered on disk (replaced by a valid file with other arrays, or a bit flipped): the
restarted controller halts that model's deployment with the reason and goes on serving the settled
version and rolling out other models; deploying the bit-flipped model is one clear error, and so
is deploying a model whose head every device would refuse (a NaN, a weight past float32)."""

import pytest

from ops_fleet import wait_for
from deployment_fleet import D_sha, model_id, store_state
from deployment_fleet import setup, world  # noqa: F401 (fixtures)


def test_a_corrupted_stored_head_halts_its_deployment_and_nothing_else(setup, world):
    """Someone with disk access replaces a stored head (a valid file, other arrays) and flips a bit
    in another: the restarted controller starts (it refused to, with StoreError), halts the
    deployment of the altered model with the reason, and goes on serving the settled version to a
    new device and rolling out another model; deploying the bit-flipped model is one clear error."""
    from aggregator.deployments.controller import CorruptModel, deployment_view
    from aggregator.storage.deployments import DeploymentStore
    from aggregator.storage.store import npz_bytes

    store, controller, fleet = setup
    W, b = world["good"]
    base, other, third, flipped = (model_id(store, name, W * k, b * k) for name, k in
                                   (("base", 1.0), ("other", 1.5), ("third", 2.0), ("flipped", 2.5)))
    for d in ("cam-0", "cam-1"):
        fleet.start(d)
    ctl = controller()
    ctl.call(lambda: ctl.deploy(base, cohort="devices:cam-0,cam-1", stages="100%", bake_s=0, min_reports=2,
                                deployment_id="base"))
    wait_for(lambda: store_state(store, "base") == "complete", what="the base rollout")
    ctl.call(lambda: ctl.deploy(other, cohort="devices:cam-0", stages="100%", bake_s=3600, deployment_id="other"))
    other_sha = D_sha((W * 1.5, b * 1.5))
    wait_for(lambda: fleet.sha("cam-0") == other_sha, what="the canary on the other head")
    ctl.stop()

    with store._tx() as db:                 # the disk: one head replaced, one bit flipped in another
        db.execute("UPDATE models SET arrays=? WHERE model_id=?",
                   (npz_bytes({"coef": world["broken"][0], "intercept": world["broken"][1]}), other))
        raw = bytearray(store.model_bytes(flipped))
        raw[len(raw) // 2] ^= 1
        db.execute("UPDATE models SET arrays=? WHERE model_id=?", (bytes(raw), flipped))

    ctl2 = controller()                     # starts: the fault is one deployment's, not the service's
    view = deployment_view(DeploymentStore(store), "other")
    assert view["state"] == "halted" and "no longer hash" in view["reason"], view["reason"]
    assert ctl2.active is None and ctl2.settled.dep.deployment_id == "base"
    assert "no longer hash" in store.setting(f"model.{other}.corrupt")
    assert fleet.sha("cam-0") == other_sha   # devices keep what they run; nothing more is sent for it

    store.enroll_device("cam-9", None, None)  # the service goes on: a new device gets the settled version
    fleet.start("cam-9")
    wait_for(lambda: fleet.sha("cam-9") == D_sha((W, b)), what="the new device on the settled version")
    with pytest.raises(CorruptModel, match="unreadable"):
        ctl2.call(lambda: ctl2.deploy(flipped, cohort="devices:cam-1", deployment_id="flipped"))
    assert DeploymentStore(store).get("flipped") is None
    ctl2.call(lambda: ctl2.deploy(third, cohort="devices:cam-1", stages="100%", bake_s=0, min_reports=1,
                                  deployment_id="third"))
    wait_for(lambda: store_state(store, "third") == "complete", what="another model's rollout")


def test_a_model_every_device_would_refuse_is_not_deployed(setup, world):
    """A review's finding: a stored model with a NaN (diverged training), or a float64 weight past
    float32's range (infinite in the head file devices read), started a rollout that the canary
    could only refuse and roll back. Deploying it is now one clear error naming the device's own
    check; nothing is created, nothing is sent, and a finite model deploys after it."""
    import numpy as np

    from aggregator.storage.deployments import DeploymentStore

    store, controller, fleet = setup
    W, b = world["good"]
    nan_W = W.copy()
    nan_W[0, 0] = np.nan
    huge_b = b.copy()
    huge_b[-1] = 1e39                       # finite in float64, inf once the head file's float32
    diverged, too_large, good = (model_id(store, name, w, c) for name, w, c in
                                 (("diverged", nan_W, b), ("too-large", W, huge_b), ("good", W, b)))
    fleet.start("cam-0")
    ctl = controller()
    for bad in (diverged, too_large):
        with pytest.raises(ValueError, match=rf"model {bad} cannot be deployed: devices refuse its head .*finite"):
            ctl.call(lambda: ctl.deploy(bad, cohort="devices:cam-0", deployment_id=f"bad-{bad}"))
        assert DeploymentStore(store).get(f"bad-{bad}") is None
    assert ctl.active is None and DeploymentStore(store).last_assignments() == {}
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=0, min_reports=1,
                                deployment_id="good"))
    wait_for(lambda: store_state(store, "good") == "complete", what="the finite model's rollout")
    assert fleet.sha("cam-0") == D_sha((W, b))
