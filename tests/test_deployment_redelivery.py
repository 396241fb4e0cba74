"""A restarted deployment controller publishes each device's last assignment again (the same
sequence) in slices of ``REDELIVERY_BATCH`` devices, one per tick, not in one go: 100,000 devices
held its thread 14-18 s (bench/deployment_restart.py), an operator's rollback and every report
waiting behind them. A device sent a newer assignment between slices is not sent the older one
after it. Without a broker: the controller's link never connects, what it publishes is recorded.
Both crash points of the re-delivery: test_deployment_rollout.py."""

import time

import numpy as np

from aggregator.deployments import controller as controller_module
from aggregator.deployments.controller import DeploymentController
from aggregator.storage.deployments import DeploymentStore
from aggregator.storage.store import Store
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.payloads import deployment as D
from protocols.topics import AGGREGATOR_ID, Topics

DEVICES = [f"cam-{i}" for i in range(7)]
TOPICS = Topics("tredelivery")


def controller(store, signer) -> tuple[DeploymentController, list[tuple[str, str, str, int]]]:
    """A controller whose link is never started, and the list of what it publishes:
    (device, deployment, action, seq) in order."""
    ctl = DeploymentController(store, BrokerConfig.from_url("mqtt://127.0.0.1:1"), TOPICS, signer=signer)
    published = []

    def record(topic, env, signer=None, retain=False, **_):
        assert retain and signer is not None and topic == TOPICS.deploy(env.body["device"])
        published.append((env.body["device"], env.body["deployment"], env.body["action"], env.body["seq"]))
        return 0
    ctl.link.publish_envelope = record
    return ctl, published


def test_a_restart_redelivers_in_slices_and_never_an_assignment_replaced_meanwhile(tmp_path, monkeypatch):
    store = Store(tmp_path / "state.db")
    for d in DEVICES:
        store.enroll_device(d, None, None)
    store.create_job("j1", "fed3r", {})
    model = store.finish_job("j1", "done", {}, {}, {"coef": np.eye(3, 4), "intercept": np.zeros(3)}, {}, 1)
    signer = DeviceIdentity.generate(AGGREGATOR_ID).sign
    first, sent = controller(store, signer)
    first.deploy(model, cohort="100%", stages="100%", bake_s=3600, deployment_id="c1")
    first._tick(time.monotonic())
    assert sorted(d for d, *_ in sent) == DEVICES and {(dep, action) for _, dep, action, _ in sent} == {("c1", D.RUN)}

    monkeypatch.setattr(controller_module, "REDELIVERY_BATCH", 3, raising=False)
    before = DeploymentStore(store).last_assignments()          # the reference: what the store says each was sent
    again, published = controller(store, signer)
    again._tick(time.monotonic())
    # one slice: the first three devices' last assignments as they were (before: all seven at once)
    assert published == [(d, "c1", D.RUN, before[d][1]) for d in DEVICES[:3]]

    again.rollback("c1", "withdrawn")               # an operator's command between slices
    rollback = DeploymentStore(store).last_assignments()
    assert all(rollback[d][1] > before[d][1] for d in DEVICES)
    for _ in range(5):
        again._tick(time.monotonic())
    assert not again._redelivery
    after_command = published[3:]
    # the rollback to every device, and no run after it: a re-delivered run (the older sequence, retained)
    # would have replaced it on the broker
    assert after_command == [(d, "c1", D.ROLLBACK, rollback[d][1]) for d in DEVICES]
    last_published = {d: seq for d, _, _, seq in published}
    assert last_published == {d: seq for d, (_, seq) in rollback.items()}
