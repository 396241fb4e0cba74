"""The deployment tests' fleet over a real mosquitto (tests/test_deployment_*.py): the held-out world
(class means, each device's held-out features, a good head and the same head with its classes
permuted), a store with the fleet enrolled, a deployment controller beside it and devices following
their retained assignment (``setup``), and the references the tests compare with. For the attacks:
a sniffer on the broker path that records and republishes, a device that lies in its reports, and
the rollout steps several attack tests start from (two versions, one settled, a tagged canary)."""

import hashlib
import time

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from aggregator.deployments.controller import DeploymentController
from aggregator.storage.store import Store
from edge_client.deployment import DeploymentFollower, ModelSlot
from protocols.envelope import Envelope, decode, encode
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.payloads import deployment as D
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


def store_state(store, deployment_id):
    from aggregator.storage.deployments import DeploymentStore

    row = DeploymentStore(store).get(deployment_id)
    return row["state"] if row else None


def D_sha(head):
    return hashlib.sha256(D.head_npz(*head)).hexdigest()


class Sniffer:
    """Anyone on the broker path: records what is published on the topics it reads, republishes at will."""

    def __init__(self, broker, topics):
        self.seen: dict[str, list[bytes]] = {}
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"sniffer-{time.monotonic_ns()}")
        self.client.on_message = lambda c, u, m: self.seen.setdefault(m.topic, []).append(bytes(m.payload))
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()
        for t in topics:
            self.client.subscribe(t, qos=1)

    def run(self, topics, device: str, deployment: str) -> bytes:
        """The signed ``run`` assignment of ``deployment`` it saw sent to ``device``."""
        return next(p for p in self.seen[topics.deploy(device)]
                    if decode(p).body.get("deployment") == deployment and decode(p).body.get("action") == "run")

    def head(self, topics, device: str, deployment: str) -> bytes:
        """The head file of ``deployment`` it saw sent to ``device``."""
        return next(p for p in self.seen[topics.deploy_in(device)] if decode(p).body.get("name") == f"{deployment}.npz")

    def publish(self, topic, payload, retain=False):
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(5)

    def close(self):
        self.client.loop_stop()
        self.client.disconnect()


def two_versions(store, world) -> tuple[tuple[int, int], tuple[str, str]]:
    """Models v1 and v2, heads of the same argmax and other bytes: ((their ids), (their sha256s))."""
    W, b = world["good"]
    return ((model_id(store, "v1", W, b), model_id(store, "v2", W * 1.5, b * 1.5)),
            (D_sha((W, b)), D_sha((W * 1.5, b * 1.5))))


def forget_session(broker, device: str) -> None:
    """``device``'s broker session gone (past its expiry, a broker without persistence): what was
    queued for it is lost, only retained messages reach it."""
    session = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{device}.deploy", clean_session=True)
    session.connect("127.0.0.1", broker.port)
    session.disconnect()


def settle(ctl, store, fleet, model: int, sha: str, deployment_id: str = "v1") -> None:
    """``model`` rolled out to cam-0 and cam-1 and complete: the settled version."""
    ctl.call(lambda: ctl.deploy(model, cohort="devices:cam-0,cam-1", stages="100%", bake_s=0, min_reports=2,
                                deployment_id=deployment_id))
    wait_for(lambda: store_state(store, deployment_id) == "complete" and fleet.sha("cam-0") == fleet.sha("cam-1") == sha,
             what=f"{deployment_id} settled on both devices")


def settled_on_v1(setup, world):
    """cam-0 and cam-1 started, a controller, v1 settled on both (``settle``): (the controller,
    (v1, v2) model ids, their sha256s)."""
    store, controller, fleet = setup
    versions, shas = two_versions(store, world)
    for d in ("cam-0", "cam-1"):
        fleet.start(d)
    ctl = controller()
    settle(ctl, store, fleet, versions[0], shas[0])
    return ctl, versions, shas


def tagged_canary(ctl, store, fleet, model: int, sha: str, deployment_id: str = "v2") -> None:
    """cam-0 tagged ``lab`` and ``model`` in a ``tags:lab`` canary baking for an hour, judged on cam-0."""
    store.set_device_tags("cam-0", ["lab"])
    ctl.call(lambda: ctl.deploy(model, cohort="tags:lab", stages="100%", bake_s=3600, deployment_id=deployment_id))
    wait_for(lambda: fleet.sha("cam-0") == sha and ctl.show(deployment_id)["devices"]["cam-0"]["report"] is not None,
             what="the candidate judged on the tagged device")


def running(slot_dir) -> str | None:
    """The sha256 of the head the slot in ``slot_dir`` runs, as its state file says (None: none yet)."""
    try:
        current = ModelSlot(slot_dir).current
    except (OSError, ValueError):       # not written yet
        return None
    return current.sha256 if current else None


def newer_assignment_ends_an_older_fetch(broker, agg, topics, device, slot_dir, good, broken, retry_s) -> None:
    """A device (any follower, seen only through the broker and its slot folder) fetching the head of
    its assignment (a canary's run, seq 2) that is then sent a newer one (the settled version's run,
    seq 4, the head it already runs: the controller's answer to the candidate's rollback, seq 3,
    which the broker path delivers after it, so it is refused as stale) no longer wants the older
    head: the candidate's signed head arriving now (late, or captured and replayed) is not swapped
    in, and the device stops asking for it. ``retry_s``: how often the device asks for a head."""
    from protocols.payloads.artifacts import GET, artifact_message

    good_head, broken_head = D.head_npz(*good), D.head_npz(*broken)
    good_sha, broken_sha = D_sha(good), D_sha(broken)
    sniffer = Sniffer(broker, [topics.deploy_out(device)])

    def sent(kind) -> list[dict]:
        return [e.body for e in map(decode, sniffer.seen.get(topics.deploy_out(device), [])) if e.type == kind]

    def assign(env, retain=True):
        sniffer.publish(topics.deploy(device), encode(env, signer=agg.sign), retain=retain)

    def head(sha, name, data):
        sniffer.publish(topics.deploy_in(device), encode(artifact_message(AGGREGATOR_ID, sha, name, data),
                                                         signer=agg.sign))

    def asked_for(sha) -> int:
        return sum(body["sha256"] == sha for body in sent(GET))
    try:
        assign(D.run_message(AGGREGATOR_ID, "s", good_sha, len(good_head), 1, device=device, seq=1))
        wait_for(lambda: asked_for(good_sha), what="the settled head asked for")
        head(good_sha, "s.npz", good_head)
        wait_for(lambda: running(slot_dir) == good_sha and len(sent(D.REPORT)) == 1, what="the settled version")
        # the candidate's run: its head is asked for and not (yet) answered
        assign(D.run_message(AGGREGATOR_ID, "c", broken_sha, len(broken_head), 2, device=device, seq=2))
        wait_for(lambda: asked_for(broken_sha), what="the candidate's head asked for")
        # the settled version's run again, judged and reported; then the candidate's rollback, stale
        assign(D.run_message(AGGREGATOR_ID, "s", good_sha, len(good_head), 1, device=device, seq=4))
        wait_for(lambda: any(r["seq"] == 4 and "n" in r for r in sent(D.REPORT)), what="the settled version under seq 4")
        assign(D.rollback_message(AGGREGATOR_ID, "c", "guard failed", device=device, seq=3), retain=False)
        wait_for(lambda: any(r.get("reason") == "stale" for r in sent(D.REPORT)), what="the stale rollback refused")
        time.sleep(3 * retry_s)             # a fetch still running asks again meanwhile
        asked = asked_for(broken_sha)
        head(broken_sha, "c.npz", broken_head)
        time.sleep(max(1.0, 3 * retry_s))   # time enough to swap, had it been taken (it takes ~10 ms)
        assert running(slot_dir) == good_sha, "the rolled-back candidate's head was swapped in"
        assert asked_for(broken_sha) == asked, "the device still asks for the older assignment's head"
        assert not [r for r in sent(D.REPORT) if r["seq"] == 2], sent(D.REPORT)
    finally:
        sniffer.publish(topics.deploy(device), b"", retain=True)
        sniffer.close()


class LyingFollower(DeploymentFollower):
    """An enrolled device that evaluates honestly, then reports what it likes: ``lie`` "inflate"
    (the candidate is perfect, its current head useless) or "deflate" (the other way round)."""
    lie = None

    def _report(self, env):
        if self.lie and "n" in env.body:
            big = 10 ** 9
            body = {**env.body, "n": big, "correct_candidate": big if self.lie == "inflate" else 0,
                    "correct_current": 0 if self.lie == "inflate" else big}
            env = Envelope(type=env.type, sender=env.sender, body=body)
        super()._report(env)
