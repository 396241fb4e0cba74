"""The aggregator signs every message it sends; a device enrolled with its public key accepts only
those: a task injected on its inbox by another client (unsigned, or signed with another key, or
claiming to be the aggregator) is refused, while the real job completes. Real mosquitto."""

import threading
import time

import numpy as np

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from edge_client.agent import DeviceAgent
from protocols import messages as M
from protocols.envelope import encode
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.topics import AGGREGATOR_ID, Topics

from test_aggregator_over_mqtt import C, D, SyntheticStats, data_for, raw_client

DEVICES = ["dev00", "dev01"]


class CountingStats(SyntheticStats):
    def __init__(self, i):
        super().__init__(i)
        self.calls = []

    def __call__(self, params, tensors=None):
        self.calls.append(params)
        return super().__call__(params, tensors)


def test_devices_refuse_messages_the_aggregator_did_not_sign(broker, tmp_path):
    aggregator = DeviceIdentity.generate(AGGREGATOR_ID)
    store = Store(tmp_path / "state.db")
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=2, round_timeout_s=30, expected_devices=2)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(tick_s=0.05), store=store, identity=aggregator)
    creds = {d: svc.enroll(d) for d in DEVICES}
    assert creds["dev00"].aggregator_public_key == aggregator.public_key_bytes.hex()
    handlers = {d: CountingStats(i) for i, d in enumerate(DEVICES)}
    bad, topics = raw_client(broker), Topics()
    forger = DeviceIdentity.generate(AGGREGATOR_ID)          # same name, another key
    for signer in (None, forger.sign):
        task = M.task_message(AGGREGATOR_ID, "evil", 1, "fed3r.stats", {"num_classes": C}, time.time() + 60)
        bad.publish(topics.inbox("dev00"), encode(task, signer=signer), qos=1).wait_for_publish(5)
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": handlers[d]}, retry_after_s=2,
                          aggregator_key=bytes.fromhex(creds[d].aggregator_public_key)).start() for d in DEVICES]
    for signer in (None, forger.sign):                       # injected while they are online, too
        task = M.task_message(AGGREGATOR_ID, "evil", 2, "fed3r.stats", {"num_classes": C}, time.time() + 60)
        bad.publish(topics.inbox("dev01"), encode(task, signer=signer), qos=1).wait_for_publish(5)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=40)), daemon=True)
    thread.start()
    thread.join(45)
    for a in agents:
        a.stop()
    bad.loop_stop()
    assert result["state"] == "done" and sorted(result["contributed"]) == DEVICES
    for d in DEVICES:                                         # only the real, signed task was ever run
        assert [p.get("num_classes") for p in handlers[d].calls] == [C]
        assert all("evil" not in str(p) for p in handlers[d].calls)
    Zb = [np.hstack([data_for(i)[0], np.ones((30, 1))]) for i in range(2)]
    np.testing.assert_allclose(np.load(tmp_path / "out" / "statistics.npz")["A"], sum(z.T @ z for z in Zb),
                               rtol=1e-12)
