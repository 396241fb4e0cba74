"""The deployment tests' fleet over a real mosquitto (tests/test_deployment_*.py): the held-out world
(class means, each device's held-out features, a good head and the same head with its classes
permuted), a store with the fleet enrolled, a deployment controller beside it and devices following
their retained assignment (``setup``), and the references the tests compare with."""

import hashlib
import time

import numpy as np
import pytest

from aggregator.deployments.controller import DeploymentController
from aggregator.storage.store import Store
from edge_client.deployment import DeploymentFollower, ModelSlot
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.payloads import deployment as D
from protocols.topics import AGGREGATOR_ID, Topics

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
