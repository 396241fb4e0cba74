"""The rollout tick at fleet scale: it reads the fleet in full once (``FleetView``), then only the
devices another writer enrolled, revoked or tagged since the last tick, and looks at only those
and the devices it sent something or heard from. Every tick read every device's row and looked at
every device (~1.1 s a tick at 100,000 devices, bench/deployment_restart.py --steady), so an
operator's command waited up to a whole tick. References: a fresh full read of the store, and a
controller that looks at the whole fleet every tick (what each tick did before)."""

import hashlib
import random
import sqlite3
import time

import numpy as np

from aggregator.deployments.cohort import CohortRule
from aggregator.deployments.controller import DeploymentController
from aggregator.deployments.guard import DEFAULT_GUARD, Guard
from aggregator.deployments.machine import Deployment, DeploymentState
from aggregator.storage.deployments import DeploymentStore
from aggregator.storage.store import Store
from protocols.files import read_npz
from protocols.mqtt_link import BrokerConfig
from protocols.payloads import deployment as D
from protocols.topics import Topics

TOPICS = Topics("fleetview")


def populated(path, devices: list[str], lab: list[str], stages=(1.0,)) -> Store:
    """v1 complete and run on every device, v2 in a ``tags:lab`` canary run on the ``lab`` devices."""
    store, table = Store(path), DeploymentStore(Store(path))
    for d in devices:
        store.enroll_device(d, None, None)
    for d in lab:
        store.set_device_tags(d, ["lab"])
    rng, fleet = np.random.default_rng(0), {d: ("lab",) if d in lab else () for d in devices}
    for version, cohort, state in (("v1", "100%", DeploymentState.COMPLETE), ("v2", "tags:lab", DeploymentState.CANARY)):
        store.create_job(version, "fed3r", {})
        model = store.finish_job(version, "done", {}, {}, {"coef": rng.normal(size=(3, 8)),
                                                           "intercept": rng.normal(size=3)}, {}, 1)
        head = D.head_npz(*D.head_arrays(read_npz(store.model_bytes(model))))
        dep = Deployment(version, model, hashlib.sha256(head).hexdigest(), CohortRule.parse(cohort),
                         stages if version == "v2" else (1.0,), Guard.parse(DEFAULT_GUARD), bake_s=3600.0,
                         state=state, stage_started_at=time.time())
        table.create(version, model, dep.state, dep.to_dict())
        table.mark_sent(version, sorted(dep.cohort.canary(fleet)), D.RUN)
    return store


def offline_controller(store: Store) -> tuple[DeploymentController, list[str]]:
    """A controller whose publishes are recorded (topic by topic), not sent: its ticks are called here."""
    ctl = DeploymentController(store, BrokerConfig.from_url("mqtt://127.0.0.1:1"), TOPICS)
    published: list[str] = []
    ctl.link.publish_envelope = lambda topic, env, **_: published.append(
        f"{topic} {env.body['deployment']} {env.body['action']}")
    return ctl, published


def full_read(path, what: str = "tags") -> dict:
    """The reference: known, not revoked devices -> operator tags (or ``what`` else of their rows:
    ``enrolled_at``), from a connection of its own."""
    store = Store(path)
    try:
        return {r["device_id"]: tuple(r["tags"]) if what == "tags" else r[what]
                for r in store.devices() if r["status"] != "revoked"}
    finally:
        store.close()


def assignments(store: Store) -> dict[str, tuple[str, str]]:
    return {r["device"]: (r["deployment_id"], r["sent"])
            for r in store.db.execute("SELECT device, deployment_id, sent FROM deployment_assignments")}


def test_a_tick_reads_only_what_another_writer_changed_and_acts_on_it(tmp_path, monkeypatch):
    """Enrolled, revoked, re-enrolled, tagged and untagged by other connections (another thread's, an
    older aggregator's plain SQL) between two ticks: the next tick sees each change, with no full read."""
    path = tmp_path / "state.db"
    devices = [f"cam-{i}" for i in range(6)]
    store = populated(path, devices, lab=["cam-0", "cam-1"])
    store.revoke_device("cam-4")
    full_reads = []                             # the controller's store's reads of every device
    for name in ("devices", "operator_fleet"):
        whole = getattr(store, name, None)
        monkeypatch.setattr(store, name, lambda *a, _whole=whole, _name=name, **k:
                            (full_reads.append(_name), _whole(*a, **k))[1], raising=False)
    ctl, published = offline_controller(store)
    ctl._roll_out(time.time())
    assert published == []                       # every device holds what it should
    read_at_start = list(full_reads)

    other = Store(path)                          # another writer: the admin API's connection
    other.enroll_device("cam-new", None, None)
    other.revoke_device("cam-5")
    other.enroll_device("cam-4", None, None)     # re-enrolled
    other.set_device_tags("cam-2", ["lab"])      # into the canary
    other.set_device_tags("cam-0", [])           # out of it
    raw = sqlite3.connect(path, isolation_level=None)   # a writer that knows nothing of the change rows
    raw.execute("DELETE FROM device_tags WHERE device_id='cam-1'")
    raw.execute("INSERT INTO devices (device_id, status) VALUES ('cam-raw', 'enrolled')")
    raw.close()
    for _ in range(2):                          # the released devices get the settled version's run next tick
        ctl._roll_out(time.time())
    assert full_reads == read_at_start, "a tick read the whole fleet"
    assert ctl.fleet.devices == full_read(path) and ctl.fleet.enrolments == full_read(path, "enrolled_at")
    assert {d: a for d, a in assignments(store).items() if d not in devices[3:4]} == {
        "cam-0": ("v1", "run"), "cam-1": ("v1", "run"),      # let go: rolled back, then the settled version
        "cam-2": ("v2", "run"), "cam-4": ("v1", "run"), "cam-5": ("v1", "run"),
        "cam-new": ("v1", "run"), "cam-raw": ("v1", "run")}
    assert sorted(p for p in published if "cam-0" in p) == [f"{TOPICS.deploy('cam-0')} {a}" for a in ("v1 run", "v2 rollback")]
    assert not any("cam-3" in p or "cam-5" in p for p in published)
    published.clear()
    ctl._roll_out(time.time())
    assert published == [] and full_reads == read_at_start


def test_ticks_send_what_a_look_at_the_whole_fleet_sends_whatever_changes(tmp_path):
    """Random enrolments, revocations and tag changes between ticks, a promotion to a wider stage and a
    rollback: each tick publishes what a controller looking at every device every tick publishes."""
    rng = random.Random(7)
    devices = [f"cam-{i:02d}" for i in range(30)]
    lab = rng.sample(devices, 5)
    stores = [populated(tmp_path / f"{way}.db", devices, lab, stages=(0.5, 1.0)) for way in ("changed", "whole")]
    (changed, sent_changed), (whole, sent_whole) = (offline_controller(s) for s in stores)

    def whole_fleet():
        whole._planned = None                   # the reference: every device looked at, every tick
        whole.fleet.enrolments = full_read(stores[1].path, "enrolled_at")
        return full_read(stores[1].path)

    whole._fleet = whole_fleet
    for step in range(60):
        for _ in range(rng.choice((0, 1, 1, 3))):
            device = rng.choice(devices + [f"new-{step}"])
            change = rng.choice(("enrol", "revoke", "tag", "untag"))
            for store in stores:
                try:
                    if change == "enrol":
                        store.enroll_device(device, None, None)
                    elif change == "revoke":
                        store.revoke_device(device)
                    else:
                        store.set_device_tags(device, ["lab"] if change == "tag" else [])
                except (KeyError, RuntimeError):
                    pass                        # enrolled already, not enrolled, unknown: the same in both stores
        if step == 20:
            for ctl in (changed, whole):
                ctl.promote("v2")               # stage 1: the canary and a seeded half of the fleet
        if step == 45:
            for ctl in (changed, whole):
                ctl.rollback("v2")
        now = time.time()
        for ctl in (changed, whole):
            ctl._roll_out(now)
        assert sent_changed == sent_whole, f"step {step}"
        assert assignments(stores[0]) == assignments(stores[1]), f"step {step}"
        assert changed.fleet.devices == full_read(stores[0].path)
        assert changed.fleet.enrolments == full_read(stores[0].path, "enrolled_at")
    assert len(sent_changed) > 40 and any("rollback" in p for p in sent_changed)
