"""A plain stateful task (``scaffold.head``, ``ditto.head``, ``pp.head``: the handler saves the
job's next state before its result goes out) that then sends nothing leaves the device's state as
it was (a review's finding): the Python agent over a real mosquitto, whose result for round 2 is
too large to encode (the agent's EnvelopeError, declined "result cannot be sent"), or whose
compute hook fails after the handler saved. The device used to decline and keep its state advanced
for a round the server never counted. The reference: the store's entry read before the failing
task, and the state a clean round 2 keeps (what the server would count). The Java device's MqttAgent
does the same (tests/test_java_stateful.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge_client.agent import AgentHooks, DeviceAgent
from edge_client.state import DeviceStateStore
from edge_client.tasks.ditto_training import DittoTrainingTask
from edge_client.tasks.scaffold_training import ScaffoldTrainingTask
from protocols import messages as M
from protocols.envelope import MAX_HEADER_BYTES, Envelope, decode, encode
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.ditto import DittoParams
from protocols.payloads.scaffold import ScaffoldParams
from protocols.payloads.stateful import StateBinding
from protocols.payloads.fedavg import LocalTraining
from protocols.payloads.task_params import ModelSpec
from protocols.topics import AGGREGATOR_ID, Topics
from deployment_fleet import Sniffer
from ops_fleet import wait_for
from stateful_jobs import pixel_extractor

T = Topics()
C, D, SIZE = 3, 8, 8
EXTRACTOR = pixel_extractor(SIZE, D)
DEVICE = "dev-s"


class Oversized:
    """A stateful handler whose result, while ``on`` holds, carries a body no envelope can hold."""

    on = False

    def __call__(self, params, tensors):
        body, out = super().__call__(params, tensors)
        return ({**body, "note": "x" * (MAX_HEADER_BYTES + 10)} if self.on else body), out


class OversizedScaffold(Oversized, ScaffoldTrainingTask):
    pass


class OversizedDitto(Oversized, DittoTrainingTask):
    pass


def task(kind: str, round_: int) -> tuple[dict, dict]:
    common = dict(model=ModelSpec(num_classes=C, backbone="b", image_size=SIZE), feature_dim=D,
                  training=LocalTraining(epochs=1, batch_size=10, lr=0.1), job_id="job-s",
                  state=StateBinding(run="0123abcd", round=round_))
    rng = np.random.default_rng(round_)
    head = {"weight": (0.1 * rng.normal(size=(C, D))).astype(np.float32), "bias": np.zeros(C, np.float32)}
    if kind == "scaffold.head":
        control = {f"control.{k}": (0.01 * rng.normal(size=v.shape)).astype(np.float32) for k, v in head.items()}
        return ScaffoldParams(**common).to_params(), {**head, **control}
    return DittoParams(**common, personal_lr=0.1, personal_epochs=1, ditto_lambda=0.5).to_params(), head


def send(sniffer, kind: str, round_: int) -> str:
    params, tensors = task(kind, round_)
    msg = M.task_message(AGGREGATOR_ID, "job-s", round_, kind, params, time.time() + 60)
    sniffer.publish(T.inbox(DEVICE), encode(Envelope(msg.type, msg.sender, msg.body, tensors, id=msg.id, ts=msg.ts)))
    return msg.id


def answer(sniffer, task_id: str):
    for payload in sniffer.seen.get(T.outbox(DEVICE), []):
        env = decode(payload)
        if env.type in (M.RESULT, M.DECLINE) and env.body["task"] == task_id:
            return env
    return None


def same(a, b) -> bool:
    return (a.run, a.round) == (b.run, b.round) and sorted(a.arrays) == sorted(b.arrays) \
        and all(np.array_equal(a.arrays[k], b.arrays[k]) for k in a.arrays)


@pytest.mark.parametrize("kind, handler_type", [("scaffold.head", OversizedScaffold), ("ditto.head", OversizedDitto)])
@pytest.mark.parametrize("failure", ["unsendable", "hook fails"])
def test_a_stateful_task_that_sends_nothing_after_its_handler_saved_puts_the_state_back(
        broker, tmp_path, kind, handler_type, failure):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (30, SIZE, SIZE, 3), dtype=np.uint8), rng.integers(0, C, 30)
    store = DeviceStateStore(tmp_path / "state")
    handler = handler_type(x, y, lambda *a, **k: EXTRACTOR, store)
    failing = {"on": False}

    def after_compute(elapsed):
        if failing["on"]:
            raise RuntimeError("the device's compute hook failed")

    sniffer = Sniffer(broker, [T.outbox(DEVICE), T.presence(DEVICE)])
    agent = DeviceAgent(DEVICE, BrokerConfig(port=broker.port), {kind: handler}, retry_after_s=0.2, tick_s=0.05,
                        hooks=AgentHooks(after_compute=after_compute), state=store).start()
    try:
        wait_for(lambda: any(decode(p).body.get("state") == "online" for p in sniffer.seen.get(T.presence(DEVICE), [])),
                 what="the agent online")
        first = send(sniffer, kind, 1)
        wait_for(lambda: answer(sniffer, first) is not None, what="round 1 answered")
        assert answer(sniffer, first).type == M.RESULT
        before = store.load("job-s", None)
        assert before.round == 1

        handler.on, failing["on"] = failure == "unsendable", failure == "hook fails"
        failed = send(sniffer, kind, 2)
        wait_for(lambda: answer(sniffer, failed) is not None, what="round 2 answered")
        got = answer(sniffer, failed)
        assert got.type == M.DECLINE, got.body
        reason = "result cannot be sent" if failure == "unsendable" else "compute hook failed"
        assert reason in got.body["reason"], got.body
        assert same(store.load("job-s", None), before)      # round 1's state, as the server counted it
    finally:
        agent.stop()
        sniffer.close()
    # what a clean round 2 would have kept differs from round 1's: the put-back is not a no-op
    handler.on = False
    clean = DeviceStateStore(tmp_path / "clean")
    reference = handler_type(x, y, lambda *a, **k: EXTRACTOR, clean)
    for r in (1, 2):
        reference(*task(kind, r))
    assert clean.load("job-s", None).round == 2 and not same(clean.load("job-s", None), before)
