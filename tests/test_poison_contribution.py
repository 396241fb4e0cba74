"""A poison contribution — signed, finite, correctly shaped, yet it breaks the solve — never
crash-loops the aggregator: it is refused or quarantined (out of the store's replay, rejected to
its device), the job finishes with the honest devices, and a restart on the same store gives the
same model. Real agents over a real mosquitto, a real SQLite store."""

import threading

import numpy as np

from starlette.testclient import TestClient

from aggregator.api.app import create_app
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from edge_client.agent import DeviceAgent
from protocols.mqtt_link import BrokerConfig

from test_admin_api import AUTH, TOKEN
from test_aggregator_over_mqtt import C, D, SyntheticStats, data_for

DEVICES = [f"dev{i:02d}" for i in range(4)]
POISONED = "dev03"


class PoisonStats(SyntheticStats):
    """Real statistics with one off-diagonal entry of A blown up: symmetric, finite, positive
    diagonal, the declared shapes — and indefinite, so A + λI has no Cholesky factor."""

    def __call__(self, params, tensors=None):
        body, tensors = super().__call__(params, tensors)
        packed = tensors["A_upper"].copy()
        packed[1] = 1e6 * abs(packed).max()              # A[0, 1] of the packed upper triangle
        return body, {**tensors, "A_upper": packed}


def run_service(broker, tmp_path, store_path):
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=len(DEVICES), round_timeout_s=20,
                         expected_devices=len(DEVICES))
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(tick_s=0.05), enrolled=set(DEVICES), store=Store(store_path))
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    return svc, thread, result


def honest_A() -> np.ndarray:
    Zb = [np.hstack([data_for(i)[0], np.ones((30, 1))]) for i, d in enumerate(DEVICES) if d != POISONED]
    return sum(z.T @ z for z in Zb)


def test_a_poison_contribution_is_kept_out_and_a_restart_does_not_replay_it(broker, tmp_path):
    store_path = tmp_path / "state.db"
    svc, thread, result = run_service(broker, tmp_path, store_path)
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url),
                          {"fed3r.stats": (PoisonStats if d == POISONED else SyntheticStats)(i)},
                          retry_after_s=1).start() for i, d in enumerate(DEVICES)]
    thread.join(60)
    for a in agents:
        a.stop()
    assert not thread.is_alive() and result["state"] == "done", result.get("state")
    assert sorted(result["contributed"]) == sorted(set(DEVICES) - {POISONED})
    np.testing.assert_allclose(np.load(tmp_path / "out" / "statistics.npz")["A"], honest_A(), rtol=1e-12)
    first_model = dict(np.load(tmp_path / "out" / "model.npz"))
    store = Store(store_path)
    assert [c.device for c in store.contributions("fed3r")].count(POISONED) == 0
    # refused at validation, or (what gets past it) quarantined with its reason, visible in the API
    quarantined = store.quarantined("fed3r")
    rejections = store.job("fed3r")["counters"]["rejections"]
    assert [q["device"] for q in quarantined] == [POISONED] or rejections.get("invalid payload", 0) >= 1, rejections
    if quarantined:
        api = TestClient(create_app(store, TOKEN, None))
        assert api.get("/api/jobs/fed3r/quarantine", headers=AUTH).json()[0]["reason"].startswith("LinAlgError")
    store.close()

    # a restart on the same store: the finished job is not replayed into a crash, same model
    svc2, thread2, result2 = run_service(broker, tmp_path, store_path)
    thread2.join(60)
    assert result2["state"] == "done"
    for name, want in first_model.items():
        assert np.array_equal(np.load(tmp_path / "out" / "model.npz")[name], want), name
