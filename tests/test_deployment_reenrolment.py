"""A revoked device id enrolled again during a rollout is a new device to it, over a real mosquitto
with the aggregator's service (enrolment, revocation, the keys reports are verified with) and its
deployment controller.

A review's finding: revoking a canary device stopped its stored report from counting, but the same
id enrolled again under a new key counted the old identity's report in the stage's decision again,
before the new identity said anything: the fleet's change rows merge a revocation and an enrolment
between two ticks into a plain change of the device, and across ticks (or a restart) the report
stored under the id was read as the device's. Now each assignment row keeps the enrolment it was
sent to (``deployment_devices.enrolled_at``): the report under it counts only while that enrolment
is the device's, and a device enrolled again is sent the run afresh, judged anew.

The reference for the new identity's report: its own held-out split (a different size from every
other device's), judged by ``deployment_fleet.correct``.
"""

import threading
import time

import pytest

from aggregator.deployments.controller import DeploymentController
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from edge_client.deployment import DeploymentFollower, ModelSlot
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.topics import AGGREGATOR_ID, Topics
from deployment_fleet import D_sha, correct, model_id, store_state, world  # noqa: F401  (world: fixture)
from ops_fleet import wait_for

CANARY = ["cam-0", "cam-1", "cam-2"]
NEW_N = 25          # the new identity's held-out size: no other device's


@pytest.fixture
def service(broker, tmp_path):
    """The service (signatures required) on its thread, its store, the aggregator's identity."""
    store = Store(tmp_path / "state.db")
    agg = DeviceIdentity.generate(AGGREGATOR_ID)
    job = Fed3RJob(Fed3RConfig(num_classes=3, feature_dim=8, expected_devices=99, start_timeout_s=1e6))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "agg",
                            ServiceSettings(tick_s=0.05, require_signatures=True), store=store, identity=agg)
    thread = threading.Thread(target=lambda: svc.run(timeout_s=300), daemon=True)
    thread.start()
    yield svc, store, agg
    svc.stop()
    thread.join(30)


def identity_of(creds) -> DeviceIdentity:
    return DeviceIdentity.from_pem(creds.device_id, creds.private_key_pem.encode())


@pytest.mark.parametrize("way", ["within one tick", "across ticks", "across a restart"])
def test_a_reenrolled_devices_old_report_no_longer_counts_and_the_new_identity_is_judged_afresh(
        service, broker, tmp_path, world, way):
    svc, store, agg = service
    topics = Topics(f"t{time.monotonic_ns()}")
    ids = {d: identity_of(svc.call(lambda d=d: svc.enroll(d))) for d in CANARY}
    good = model_id(store, "good", *world["good"])
    followers = []

    def follow(device, identity, holdout):
        f = DeploymentFollower(device, BrokerConfig.from_url(broker.url), ModelSlot(tmp_path / device),
                               lambda bundle: holdout, topics=topics, aggregator_key=agg.public_key_bytes,
                               signer=identity.sign, retry_s=0.5, fetch_timeout_s=10)
        followers.append(f.start())
        return f

    def controller():
        return DeploymentController(store, BrokerConfig.from_url(broker.url), topics, signer=agg.sign,
                                    verifier=svc.fleet.verify, tick_s=0.05).start()

    def report(ctl, device):
        return ctl.call(lambda: ctl.show("c")["devices"][device]["report"])

    ctl = controller()
    try:
        old = follow("cam-2", ids["cam-2"], world["holdout"]["cam-2"])
        ctl.call(lambda: ctl.deploy(good, cohort="devices:" + ",".join(CANARY), stages="100%", bake_s=0,
                                    min_reports=3, patience_s=3600, deployment_id="c"))
        wait_for(lambda: report(ctl, "cam-2") is not None, what="the old identity's report")
        old.stop()
        if way == "within one tick":            # on the controller's thread: no tick between the two
            successor = ctl.call(lambda: svc.call(lambda: (svc.revoke("cam-2"), svc.enroll("cam-2"))[1]))
        elif way == "across ticks":
            svc.call(lambda: svc.revoke("cam-2"))
            wait_for(lambda: ctl.call(lambda: "cam-2" not in ctl.fleet.devices), what="a tick without cam-2")
            time.sleep(0.2)                     # a few ticks more
            successor = svc.call(lambda: svc.enroll("cam-2"))
        else:
            ctl.stop()
            svc.call(lambda: svc.revoke("cam-2"))
            successor = svc.call(lambda: svc.enroll("cam-2"))
            ctl = controller()
        for d in ("cam-0", "cam-1"):
            follow(d, ids[d], world["holdout"][d])
        wait_for(lambda: all(report(ctl, d) is not None for d in ("cam-0", "cam-1")), what="the others' reports")
        time.sleep(1.0)                         # twenty ticks: a third report would have passed the canary
        assert store_state(store, "c") == "canary", "the revoked identity's report counted"
        assert report(ctl, "cam-2") is None, "the old identity's report is still the device's"

        # the new identity on the same device (its slot kept: it already runs the head, under the
        # old identity's assignment): sent the run afresh, it judges the head and its report counts
        Z, y = world["holdout"]["cam-9"]
        follow("cam-2", identity_of(successor), (Z[:NEW_N], y[:NEW_N]))
        wait_for(lambda: store_state(store, "c") == "complete", what="the canary passed on three reports")
        view = ctl.call(lambda: ctl.show("c"))
        metrics = view["history"][-1]["metrics"]
        assert metrics["reports"] == 3 and metrics["evidence"]["cam-2"]["n"] == NEW_N, metrics
        assert view["devices"]["cam-2"]["report"]["correct_candidate"] == correct(world["good"], Z[:NEW_N], y[:NEW_N])
        assert view["devices"]["cam-2"]["enrolled_at"] == store.device("cam-2")["enrolled_at"]
    finally:
        for f in followers:
            f.stop()
        ctl.stop()


def test_a_version_4_stores_assignments_are_given_their_devices_enrolments_and_a_new_one_judges_anew(tmp_path):
    """A store made before ``deployment_devices.enrolled_at`` (schema version 4) gains it when opened,
    each row given its device's enrolment then (its report counts on, as it did), kept across opens;
    a run to the same enrolment keeps the report, a run to the id enrolled again clears it."""
    import sqlite3

    from aggregator.storage.deployments import DeploymentStore
    from aggregator.storage.schema import SCHEMA_VERSION
    from protocols.payloads import deployment as D

    path = tmp_path / "state.db"
    store = Store(path)
    for d in ("cam-0", "cam-1"):
        store.enroll_device(d, None, None)
    DeploymentStore(store).create("dep", 1, "canary", {})
    store.close()
    db = sqlite3.connect(path, isolation_level=None)        # the table as version 4 made it, a report in it
    db.executescript("BEGIN; ALTER TABLE deployment_devices DROP COLUMN enrolled_at; "
                     "UPDATE meta SET value='4' WHERE key='schema_version'; "
                     "INSERT INTO deployment_devices VALUES ('dep', 'cam-0', 'run', 1.0, '{\"n\": 40}'); "
                     "INSERT INTO deployment_devices VALUES ('dep', 'cam-1', 'run', 1.0, '{\"n\": 30}'); COMMIT;")
    db.close()
    for _ in range(2):                                       # migrated once, then as it is
        store = Store(path)
        table = DeploymentStore(store)
        assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
        assert {d: row["enrolled_at"] for d, row in table.devices("dep").items()} == \
            {d: store.device(d)["enrolled_at"] for d in ("cam-0", "cam-1")}
        store.close()
    store = Store(path)
    table = DeploymentStore(store)
    store.revoke_device("cam-1")
    store.enroll_device("cam-1", None, None)
    seq, enrolments = table.mark_sent("dep", ["cam-0", "cam-1"], D.RUN)
    assert enrolments == {d: store.device(d)["enrolled_at"] for d in ("cam-0", "cam-1")}
    after = table.devices("dep")
    assert after["cam-0"]["report"] == {"n": 40} and after["cam-1"]["report"] is None
    assert {d: after[d]["enrolled_at"] for d in after} == enrolments
    store.close()
