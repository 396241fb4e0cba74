"""The aggregator service over a real mosquitto: real device agents, plus a hostile raw client.

Features here are synthetic (the backbone is tested elsewhere) so the test is about transport,
validation and state: bad input is rejected with a reason and leaves the sums untouched.
"""

import threading
import time

import numpy as np
import paho.mqtt.client as mqtt

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service import AggregatorService
from edge_client.agent import DeviceAgent
from edge_client.fed3r import Fed3RAccumulator
from protocols import messages as M
from protocols.envelope import encode
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fed3r import encode_stats
from protocols.topics import Topics

D, C = 6, 3


def data_for(i):
    rng = np.random.default_rng(i)
    return rng.normal(size=(30, D)), rng.integers(0, C, 30)


class SyntheticStats:
    """A task handler computing real Fed3R statistics of fixed synthetic features."""

    def __init__(self, i, gate=None):
        self.Z, self.y = data_for(i)
        self.gate = gate

    def __call__(self, params, tensors=None):
        if self.gate is not None:
            self.gate.wait(30)
        acc = Fed3RAccumulator(C, D)
        acc.update(self.Z, self.y)
        A, ids, b = acc.sparse()
        return encode_stats(A, ids, b, acc.n, C)


def start_service(broker, tmp_path, devices, **cfg):
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=len(devices), round_timeout_s=20,
                         expected_devices=len(devices), **cfg)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path, enrolled=set(devices))
    result = {}
    t = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    t.start()
    return svc, t, result


def raw_client(broker):
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="intruder")
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    return c


def test_fed3r_over_mosquitto_with_hostile_traffic_equals_plain_sum(broker, tmp_path):
    devices = [f"dev{i:02d}" for i in range(4)]
    gate = threading.Event()       # devices hold their results until the hostile traffic is in
    svc, thread, result = start_service(broker, tmp_path, devices)
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(i, gate)},
                          retry_after_s=2).start() for i, d in enumerate(devices)]
    topics = Topics()
    bad = raw_client(broker)
    deadline = time.time() + 20
    while svc.job.round == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert svc.job.round == 1
    ref = M.TaskRef(svc.job.config.job_id, 1, "x" * 32)

    def stats_msg(sender, mutate=None, **body_over):
        Z, y = data_for(99)
        acc = Fed3RAccumulator(C, D)
        acc.update(Z, y)
        A, ids, b = acc.sparse()
        body, tensors = encode_stats(A, ids, b, acc.n, C)
        if mutate:
            mutate(tensors)
        body.update(body_over)
        return M.result_message(sender, ref, "fed3r.stats", body, tensors)

    hostile = [
        (topics.outbox("dev00"), b"garbage"),                                                  # not an envelope
        (topics.outbox("dev00"), encode(stats_msg("dev01"))),                                  # spoofed sender
        (topics.outbox("stranger"), encode(stats_msg("stranger"))),                            # unknown device
        (topics.outbox("dev00"), encode(stats_msg("dev00", lambda t: t.__setitem__("b", t["b"] * np.nan)))),
        (topics.outbox("dev00"), encode(stats_msg("dev00", lambda t: t.__setitem__("A_upper", t["A_upper"][:-1])))),
        (topics.outbox("dev00"), encode(stats_msg("dev00", p=D + 5))),                         # wrong shape claim
        (topics.outbox("dev00"), encode(stats_msg("dev00", n=-3))),
        (topics.outbox("dev00"), encode(stats_msg("dev00", job="other-job"))),
        (topics.outbox("dev00"), encode(stats_msg("dev00", round=7))),
    ]
    for topic, payload in hostile:
        bad.publish(topic, payload, qos=1).wait_for_publish(5)
    time.sleep(1.0)
    assert svc.job.strategy.n_contributions == 0 and np.count_nonzero(svc.job.strategy.A.cpu().numpy()) == 0
    gate.set()
    thread.join(60)
    for a in agents:
        a.stop()
    bad.loop_stop()
    assert result["state"] == "done"
    # the invalid-payload messages from dev00 were rejected, but dev00 still contributed its real result
    assert set(result["contributed"]) == set(devices)
    rej = result["rejections"]
    assert rej.get("malformed", 0) >= 1 and rej.get("unknown device (not enrolled)", 0) == 1
    assert sum(rej.values()) >= 5
    # accumulated statistics == plain numpy sum over the four devices
    A_ref = sum(np.hstack([data_for(i)[0], np.ones((30, 1))]).T @ np.hstack([data_for(i)[0], np.ones((30, 1))])
                for i in range(4))
    state = np.load(tmp_path / "statistics.npz")
    np.testing.assert_allclose(state["A"], A_ref, rtol=1e-12)


def test_duplicate_deliveries_are_applied_once(broker, tmp_path):
    devices = ["solo"]
    svc, thread, result = start_service(broker, tmp_path, devices)
    agent = DeviceAgent("solo", BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(0)},
                        retry_after_s=0.3)  # aggressive retries -> the server sees the same id several times
    agent.start()
    thread.join(60)
    agent.stop()
    assert result["state"] == "done" and result["results_accepted"] == 1
    assert svc.job.strategy.n_samples == 30



def test_signed_agents_are_accepted_and_wrongly_signed_ones_rejected(broker, tmp_path):
    from protocols.identity import DeviceIdentity

    devices = ["good", "forger"]
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=2, round_timeout_s=8, expected_devices=1,
                         start_timeout_s=3, max_attempts=1)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path, enrolled=set(devices),
                            require_signatures=True)
    keys = {d: DeviceIdentity.generate(d) for d in devices}
    for d in devices:
        svc.registry.enroll(d, keys[d].public_key_bytes)
    impostor = DeviceIdentity.generate("forger")          # not the enrolled key
    result = {}
    t = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    t.start()
    agents = [DeviceAgent("good", BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(0)},
                          signer=keys["good"].sign).start(),
              DeviceAgent("forger", BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(1)},
                          signer=impostor.sign).start()]
    t.join(60)
    for a in agents:
        a.stop()
    assert list(result["contributed"]) == ["good"]
    assert result["rejections"].get("bad signature", 0) >= 1


def test_a_failing_protocol_handler_declines_and_the_agent_lives_on(broker):
    """A multi-message handler that raises (bad local data, a bug) must not kill the agent thread:
    the device declines the task and keeps answering later tasks."""
    import queue

    from protocols.chunking import MessageAssembler

    class Flaky:
        calls = 0

        def on_task(self, job, round_, params, tensors):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise ValueError("features contain NaN")
            return []

        def on_message(self, env):
            return []

    topics = Topics()
    got: queue.Queue = queue.Queue()
    spy = raw_client(broker)
    spy.on_message = lambda c, u, m: got.put(m.payload)
    spy.subscribe(topics.outbox("flaky"), qos=1)
    agent = DeviceAgent("flaky", BrokerConfig.from_url(broker.url), {},
                        protocol_handlers={"fed3r.secure": Flaky()}).start()
    time.sleep(0.5)
    for r in (1, 2):
        task = M.task_message("aggregator", "j", r, "fed3r.secure", {}, time.time() + 60)
        spy.publish(topics.inbox("flaky"), encode(task), qos=1)
    deadline = time.time() + 10
    declines = []
    while time.time() < deadline and not (declines and Flaky.calls == 2):
        try:
            env = MessageAssembler().feed(got.get(timeout=0.2))
        except queue.Empty:
            continue
        if env is not None and env.type == M.DECLINE:
            declines.append(env.body)
    agent.stop()
    spy.loop_stop()
    assert [d["round"] for d in declines] == [1] and "NaN" in declines[0]["reason"]
    assert Flaky.calls == 2            # the second task still reached the handler
