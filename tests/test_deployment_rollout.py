"""Model rollout over a real mosquitto (issue 29): the deployment controller beside a store, devices
following their retained assignment with :class:`edge_client.deployment.DeploymentFollower`.

* promotion reaches every enrolled device, and each device's reported counts are the held-out
  counts computed here with numpy; the application predicts with the deployed head;
* a failing guard (a head with permuted classes) rolls every canary device back to the version
  it kept, and the devices outside the canary never see the candidate;
* an offline device receives the current version when it comes online;
* an unsigned assignment (when the device holds the aggregator's key) and a tampered head are
  refused: the device keeps running its version and says why;
* a restarted controller resumes the same deployment and re-sends nothing;
* a device that personalises (OLL) judges and predicts with the head pruned to its local labels.
"""

import hashlib
import os
import re
import time

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from aggregator.deployments.controller import DeploymentController
from aggregator.storage.store import Store
from edge_client.deployment import DeploymentFollower, ModelSlot
from protocols.envelope import encode
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.payloads import deployment as D
from protocols.payloads.artifacts import artifact_message
from protocols.topics import AGGREGATOR_ID, Topics
from ops_fleet import wait_for

C, DIM, N_HOLDOUT = 3, 8, 40
DEVICES = [f"cam-{i}" for i in range(6)]


@pytest.fixture(scope="module")
def world():
    """Class means, each device's held-out features, a good head and the same head with classes permuted."""
    rng = np.random.default_rng(0)
    means = rng.normal(0, 3, (C, DIM))
    holdout = {}
    for d in DEVICES + ["cam-9"]:
        y = rng.integers(0, C, N_HOLDOUT)
        holdout[d] = (means[y] + rng.normal(0, 1.5, (N_HOLDOUT, DIM)), y)
    W, b = means, -0.5 * (means ** 2).sum(1)                 # nearest class mean
    perm = np.array([1, 2, 0])
    return {"holdout": holdout, "good": (W, b), "broken": (W[perm], b[perm])}


def model_id(store, job_id, W, b):
    store.create_job(job_id, "fed3r", {})
    return store.finish_job(job_id, "done", {}, {}, {"coef": W, "intercept": b}, {}, 1)


def oll_correct(head, Z, y, local_labels):
    """Independent reference for OLL: only the rows of the local classes compete; the argmax's
    row is mapped back to its class id (held-out samples of other classes are always wrong)."""
    W, b = (np.asarray(a, dtype=np.float32).astype(np.float64) for a in head)
    rows = sorted(set(int(c) for c in local_labels))
    pred = np.array(rows)[(Z @ W[rows].T + b[rows]).argmax(1)]
    return int((pred == y).sum()), pred


def correct(head, Z, y):
    """Independent reference: the head as devices receive it (float32), argmax of the logits."""
    W, b = (np.asarray(a, dtype=np.float32).astype(np.float64) for a in head)
    return int(((Z @ W.T + b).argmax(1) == y).sum())


class Fleet:
    def __init__(self, broker, tmp_path, world, key=None):
        self.broker, self.tmp, self.world, self.key = BrokerConfig.from_url(broker.url), tmp_path, world, key
        self.topics = Topics(f"t{time.monotonic_ns()}")       # retained messages of other tests stay apart
        self.followers = {}

    def start(self, device, local_labels=None, holdout=None, fetch_timeout_s=10):
        f = DeploymentFollower(device, self.broker, ModelSlot(self.tmp / device, local_labels),
                               holdout or (lambda bundle: self.world["holdout"][device]),
                               topics=self.topics, aggregator_key=self.key, retry_s=0.5, fetch_timeout_s=fetch_timeout_s)
        self.followers[device] = f.start()
        return f

    def sha(self, device):
        cur = self.followers[device].slot.current
        return cur.sha256 if cur else None

    def stop(self):
        for f in self.followers.values():
            f.stop()


@pytest.fixture
def setup(broker, tmp_path, world):
    store = Store(tmp_path / "state.db")
    for d in DEVICES:
        store.enroll_device(d, None, None)
    agg = DeviceIdentity.generate(AGGREGATOR_ID)
    controllers, fleet = [], Fleet(broker, tmp_path, world, key=agg.public_key_bytes)

    def controller():
        c = DeploymentController(store, BrokerConfig.from_url(broker.url), fleet.topics, signer=agg.sign,
                                 tick_s=0.05).start()
        controllers.append(c)
        return c
    yield store, controller, fleet
    fleet.stop()
    for c in controllers:
        c.stop()


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


def test_unsigned_assignments_and_tampered_heads_are_refused_and_the_device_keeps_its_version(setup, world, broker):
    store, controller, fleet = setup
    T = fleet.topics
    good = model_id(store, "good", *world["good"])
    ctl = controller()
    for d in ("cam-0", "cam-1"):
        fleet.start(d)
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0,cam-1", stages="100%", bake_s=0.1, min_reports=2,
                                deployment_id="good-1"))
    good_sha = D_sha(world["good"])
    wait_for(lambda: fleet.sha("cam-0") == good_sha and fleet.sha("cam-1") == good_sha, what="the swap")

    raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="intruder")
    raw.connect("127.0.0.1", broker.port)
    raw.loop_start()
    try:
        evil = D.head_npz(*world["broken"])
        sha = hashlib.sha256(evil).hexdigest()
        # unsigned, on a device holding the aggregator's key: refused before anything is fetched
        raw.publish(T.deploy("cam-0"), encode(D.run_message(AGGREGATOR_ID, "evil", sha, len(evil), 1,
                                                                     device="cam-0", seq=2 ** 61)),
                    qos=1, retain=True).wait_for_publish(5)
        wait_for(lambda: fleet.followers["cam-0"].refusals, what="the unsigned assignment's refusal")
        assert "unsigned" in fleet.followers["cam-0"].refusals[-1] or "signature" in fleet.followers["cam-0"].refusals[-1]
        assert fleet.sha("cam-0") == good_sha

        # a device without the key (and unknown to the controller) takes the assignment, but a head
        # that does not hash to it is refused
        trusting = DeploymentFollower("stranger", BrokerConfig.from_url(broker.url), ModelSlot(fleet.tmp / "stranger"),
                                      lambda bundle: world["holdout"]["cam-5"], topics=T, retry_s=0.3,
                                      fetch_timeout_s=10).start()
        fleet.followers["stranger"] = trusting
        asked = []
        raw.on_message = lambda c, u, m: asked.append(m.topic)
        raw.subscribe(T.deploy_out("stranger"), qos=1)
        raw.publish(T.deploy("stranger"), encode(D.run_message(AGGREGATOR_ID, "evil", sha, len(evil), 1,
                                                                       device="stranger", seq=1)),
                    qos=1, retain=True).wait_for_publish(5)
        wait_for(lambda: asked, what="the device to ask for the head")
        tampered = evil[:-1] + bytes([evil[-1] ^ 1])
        raw.publish(T.deploy_in("stranger"), encode(artifact_message(AGGREGATOR_ID, sha, "evil.npz", tampered)),
                    qos=1).wait_for_publish(5)
        wait_for(lambda: trusting.refusals, what="the tampered head's refusal")
        assert "differs from the requested" in trusting.refusals[-1] and trusting.slot.current is None
        assert trusting.reports[-1]["refused"] == trusting.refusals[-1]
    finally:
        raw.publish(T.deploy("cam-0"), b"", retain=True).wait_for_publish(5)
        raw.publish(T.deploy("stranger"), b"", retain=True).wait_for_publish(5)
        raw.loop_stop()
        raw.disconnect()


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


def store_state(store, deployment_id):
    from aggregator.storage.deployments import DeploymentStore

    row = DeploymentStore(store).get(deployment_id)
    return row["state"] if row else None


def D_sha(head):
    return hashlib.sha256(D.head_npz(*head)).hexdigest()


TOKEN = "deploy-token-0123456789abcdef"


def test_the_operator_deploys_promotes_and_rolls_back_through_the_cli(setup, world, capsys):
    from starlette.testclient import TestClient

    from aggregator.api.app import create_app
    from aggregator.api.server import ApiServer
    from fedfleet.admin import main as admin

    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    devices = DEVICES[:4]
    for d in devices:
        fleet.start(d)
    ctl = controller()
    api = ApiServer(create_app(store, TOKEN, None, ctl)).start()
    base = ["--url", api.url, "--token", TOKEN]

    def cli(*args, ok=True):
        capsys.readouterr()
        rc = admin([*args, *base])
        out = capsys.readouterr()
        assert (rc == 0) == ok, (args, rc, out.err)
        return out.out if ok else out.err

    try:
        out = cli("model", "deploy", str(good), "--cohort", "devices:cam-0", "--stages", "50%,100%", "--bake", "1h",
                  "--deployment-id", "ops-1")
        assert "deployment ops-1: model" in out and "canary" in out and "stages devices:cam-0 -> 50% -> 100%" in out
        good_sha = D_sha(world["good"])
        wait_for(lambda: fleet.sha("cam-0") == good_sha, what="the canary device to swap")
        assert all(fleet.sha(d) is None for d in devices[1:])               # a one-hour bake: nobody else yet
        assert "ops-1 is canary" in cli("model", "deploy", str(good), ok=False)
        assert "widening" in cli("deployment", "promote", "ops-1")          # 50 %
        assert "now stage 2" in cli("deployment", "promote", "ops-1")      # 100 %
        assert "complete" in cli("deployment", "promote", "ops-1")
        wait_for(lambda: all(fleet.sha(d) == good_sha for d in devices), what="every device to swap")
        assert "is complete" in cli("deployment", "promote", "ops-1", ok=False)
        out = cli("deployment", "rollback", "ops-1", "--reason", "field complaints")
        assert "rolled_back" in out and "reason    field complaints" in out
        wait_for(lambda: all(fleet.sha(d) is None for d in devices), what="every device back to its own version")
        line = cli("deployments").splitlines()[-1]
        assert line.startswith("ops-1") and "rolled_back" in line and "field complaints" in line
        shown = cli("deployment", "show", "ops-1")
        assert "canary -> widening: promoted by the operator" in shown and "cam-0" in shown
        # admin logs: every state change with its reason, in the job log's line format
        logged = cli("logs", "--deployment", "ops-1").splitlines()
        assert [line.split()[1:3] for line in logged] == [["canary", "deployment_id=ops-1"],
                                                          ["widening", "deployment_id=ops-1"],
                                                          ["widening", "deployment_id=ops-1"],
                                                          ["complete", "deployment_id=ops-1"],
                                                          ["rolled_back", "deployment_id=ops-1"]]
        assert "why=promoted by the operator" in logged[1] and "why=field complaints" in logged[-1]
        assert "admin logs: name a job" in cli("logs", ok=False)
        assert "admin logs: name a job" in cli("logs", "job", "--deployment", "ops-1", ok=False)
        assert "HTTP 404" in cli("logs", "--deployment", "nope", ok=False)

        client = TestClient(create_app(store, TOKEN, None, ctl))
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert client.post("/api/models/999/deploy", headers=auth, json={}).status_code == 404
        bad = client.post(f"/api/models/{good}/deploy", headers=auth, json={"guard": "accuracy>0"})
        assert bad.status_code == 422 and "METRIC OP NUMBER" in bad.json()["detail"]
        assert client.get("/api/deployments/nope", headers=auth).status_code == 404
        history = client.get("/api/deployments/ops-1", headers=auth).json()["history"]
        page = client.get("/api/deployments/ops-1/log?offset=3", headers=auth).json()
        assert page["next_offset"] == len(history) == 5 and page["state"] == "rolled_back"
        assert [(e["from"], e["event"], e["why"]) for e in page["lines"]] == \
            [(h["from"], h["to"], h["why"]) for h in history[3:]]
        assert client.get("/api/deployments/ops-1/log?offset=9", headers=auth).json() == \
            {"lines": [], "next_offset": 9, "state": "rolled_back"}
        assert client.get("/api/deployments/ops-1/log?offset=-1", headers=auth).status_code == 422
        read_only = TestClient(create_app(store, TOKEN))
        assert read_only.post(f"/api/models/{good}/deploy", headers=auth, json={}).status_code == 409
        assert read_only.get("/api/deployments/ops-1", headers=auth).json()["state"] == "rolled_back"
    finally:
        api.stop()


@pytest.mark.parametrize("lost", ["gone", "fifo"])
def test_a_kept_head_whose_file_is_gone_is_refused_with_the_reason_and_the_device_keeps_its_version(setup, world, lost):
    """The device runs v2 and keeps v1's head; v1's file is lost on disk (or, a review's finding, a
    FIFO stands in its place, which the plain read waited on for ever); v1's model deployed again
    (the kept version, read from the slot, not fetched) is refused with why, reported, and the device
    stays on v2 (the read error used to escape the handler: no refusal, no report)."""
    store, controller, fleet = setup
    good, other = model_id(store, "good", *world["good"]), model_id(store, "other", *world["broken"])
    follower = fleet.start("cam-0")
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=0, min_reports=1, deployment_id="v1"))
    wait_for(lambda: store_state(store, "v1") == "complete", what="v1")
    ctl.call(lambda: ctl.deploy(other, cohort="devices:cam-0", stages="100%", bake_s=3600, deployment_id="v2"))
    ctl.call(lambda: ctl.promote("v2"))
    ctl.call(lambda: ctl.promote("v2"))
    wait_for(lambda: fleet.sha("cam-0") == D_sha(world["broken"]), what="v2")
    (follower.slot.dir / f"{D_sha(world['good'])}.npz").unlink()
    if lost == "fifo":
        os.mkfifo(follower.slot.dir / f"{D_sha(world['good'])}.npz")
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=3600, min_reports=1,
                                deployment_id="v3"))
    wait_for(lambda: follower.refusals, what="the refusal")
    assert follower.refusals[-1].startswith("kept head unreadable, staying on the current version")
    wait_for(lambda: ctl.show("v3")["counts"].get("refused:load") == 1, what="the refusal reported")
    assert fleet.sha("cam-0") == D_sha(world["broken"])


def test_an_assignment_the_slot_cannot_write_is_refused_and_reported(setup, world):
    """A review's finding: when the slot could not record an assignment's sequence (disk full, a
    read-only folder: here a directory stands where slot.json is renamed to), the Python follower's
    error escaped to its loop's log as a traceback, where the Java follower refuses it (and reports
    the refusal against the version it runs, as every refusal of no assignment being acted on).
    Nothing is acted on: the assignment's sequence is not durable."""
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    follower = fleet.start("cam-0")
    ctl = controller()
    state = follower.slot.dir / "slot.json"
    if state.exists():
        state.unlink()
    state.mkdir()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=3600, min_reports=1,
                                deployment_id="v1"))
    wait_for(lambda: follower.refusals, what="the refusal")
    assert re.match(r"assignment \d+ not written: .*slot\.json.* is not a regular file", follower.refusals[-1])
    assert follower.slot.current is None and follower.loop.alive           # nothing acted on; the follower goes on


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


def test_a_head_written_to_a_full_disk_leaves_no_partial_file(tmp_path, monkeypatch):
    """The slot's atomic write (``protocols.files.write_atomic``, the state store's too) fails
    (ENOSPC at the sync): its temp file is removed, so a retry is not starved of the space the
    failed attempt took (each attempt used to leave one behind), and the old file stays."""
    import errno
    import os

    from protocols import files

    (tmp_path / "head.npz").write_bytes(b"old")
    slot, head = ModelSlot(tmp_path / "slot"), D.head_npz(np.zeros((3, 4), np.float32), np.zeros(3, np.float32))
    kept = sorted(set(os.listdir(tmp_path / "slot")) - {".slot.lock"})

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        slot.swap(head, hashlib.sha256(head).hexdigest(), "d1")
    with pytest.raises(OSError, match="No space"):
        files.write_atomic(tmp_path / "head.npz", b"x" * 1000)
    assert sorted(os.listdir(tmp_path)) == ["head.npz", "slot"] and (tmp_path / "head.npz").read_bytes() == b"old"
    # nothing partial is left (the folder's lock file, made by the commit that failed, is no head)
    assert sorted(set(os.listdir(tmp_path / "slot")) - {".slot.lock"}) == kept and slot.current is None


def test_a_folder_that_refuses_fsync_does_not_fail_a_replacement_already_made(tmp_path, monkeypatch):
    """Some filesystems refuse fsync on a folder (EINVAL) or the folder cannot be opened: the
    rename is done by then, so ``write_atomic`` returns (as PostgreSQL's fsync_fname does) and the
    slot swaps in memory too; it used to raise after the new head was already on disk."""
    import errno
    import stat

    from protocols import files

    real_fsync, real_fstat = files.os.fsync, os.fstat

    def refusing(fd):
        if stat.S_ISDIR(real_fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fsync(fd)
    monkeypatch.setattr(files.os, "fsync", refusing)
    slot, head = ModelSlot(tmp_path / "slot"), D.head_npz(np.zeros((3, 4), np.float32), np.zeros(3, np.float32))
    slot.swap(head, hashlib.sha256(head).hexdigest(), "d1")
    assert slot.current.deployment == "d1" and ModelSlot(tmp_path / "slot").current.deployment == "d1"


class FlakyHoldout:
    """The application's held-out features, failing its first ``failures`` reads (a disk busy, a
    store being rotated) and then giving the device's split."""

    def __init__(self, features, failures):
        self.features, self.failures, self.reads = features, failures, 0

    def __call__(self, bundle):
        self.reads += 1
        if self.reads <= self.failures:
            raise OSError(f"held-out store unavailable (read {self.reads})")
        return self.features


def test_a_passing_failure_of_the_devices_features_is_tried_again_not_reported_as_a_refusal(setup, world):
    """The device tries the held head again every retry_s: the rollout sees its counts, no refusal,
    and a guard of ``refused<=0`` completes. One whose features never come back refuses once the
    fetch timeout has passed since the first failure, saying why."""
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    flaky = FlakyHoldout(world["holdout"]["cam-0"], failures=2)
    follower = fleet.start("cam-0", holdout=flaky)
    broken = FlakyHoldout(None, failures=10 ** 9)
    stuck = fleet.start("cam-1", holdout=broken, fetch_timeout_s=1.5)
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0", stages="100%", bake_s=0.1, min_reports=1,
                                guard="refused<=0", deployment_id="good-1"))
    wait_for(lambda: store_state(store, "good-1") == "complete", what="the rollout despite two failed reads")
    Z, y = world["holdout"]["cam-0"]
    assert flaky.reads == 3 and not follower.refusals and fleet.sha("cam-0") == D_sha(world["good"])
    report = follower.reports[-1]
    assert "refused" not in report and (report["n"], report["correct_candidate"]) == (len(y), correct(world["good"], Z, y))
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-1", stages="100%", bake_s=0.1, min_reports=1,
                                deployment_id="good-2"))
    wait_for(lambda: stuck.refusals, what="the refusal after the fetch timeout")
    assert "not adopted within 1.5s" in stuck.refusals[-1] and "held-out store unavailable" in stuck.refusals[-1]
    assert stuck.reports[-1]["reason"] == "load" and stuck.slot.current is None
    assert broken.reads >= 3          # tried again, every retry_s, before refusing
    reads = broken.reads
    time.sleep(1.2)                   # and not after
    assert broken.reads == reads


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


def test_the_running_head_deployed_anew_is_judged_once_and_comes_from_the_new_deployment(setup, world, broker):
    """A review's finding: the device kept the running head's old deployment name, so every
    re-delivery of the new deployment's retained assignment (each reconnect) judged it on the
    held-out split and reported again, and the new deployment's rollback did not revert it."""
    from test_deployment_attacks import Sniffer

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


def test_two_rollbacks_in_a_row_leave_no_device_without_a_head(setup, world):
    store, ctl, fleet, broken, shas = _three_versions(setup, world)
    ctl.call(lambda: ctl.deploy(broken, cohort="devices:cam-0", stages="100%", bake_s=0, min_reports=1,
                                deployment_id="B"))
    wait_for(lambda: store_state(store, "B") == "rolled_back", what="the guard rolls B back")
    wait_for(lambda: fleet.sha("cam-0") == shas["a"], what="cam-0 back on A")
    ctl.call(lambda: ctl.rollback("A", "A is withdrawn"))
    wait_for(lambda: _running(fleet, shas) == {"cam-0": "z", "cam-1": "z", "cam-2": "z"}, timeout=30,
             what="Z everywhere")
