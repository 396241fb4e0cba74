"""FedAvg / FedAvgM over mosquitto: the global head travels in task tensors, devices train
locally (the real HeadTrainingTask), and the aggregated head equals an in-process replay of the
same rounds (same participants, same device code, no transport)."""

import threading

import numpy as np
import pytest
from ops_fleet import Features, replay_round

from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.agent import DeviceAgent
from edge_client.tasks.head_training import HeadTrainingTask
from protocols.mqtt_link import BrokerConfig

D, C, N = 6, 3, 30


def device_task(i):
    rng = np.random.default_rng(7 + i)
    y = rng.integers(0, C, N)
    Z = (rng.normal(size=(N, D)) + 2 * np.eye(C, D)[y]).astype(np.float32)
    return HeadTrainingTask(Z, y, lambda b, s, w: Features(D))


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["fedavg", "fedavgm"])
def test_fedavg_over_mosquitto_equals_in_process_replay(broker, tmp_path, momentum):
    ids = [f"dev{i}" for i in range(5)]
    cfg = dict(job_id="ft", num_classes=C, feature_dim=D, rounds=3, clients_per_round=3, round_timeout_s=30,
               local_epochs=2, batch_size=8, client_lr=0.05, server_momentum=momentum, expected_devices=5, seed=3)
    job = FedAvgJob(FedAvgConfig(**cfg))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path,
                            ServiceSettings(evaluate_every_contribution=False), enrolled=set(ids))
    result = {}
    t = threading.Thread(target=lambda: result.update(svc.run(timeout_s=120)), daemon=True)
    t.start()
    tasks = {d: device_task(i) for i, d in enumerate(ids)}
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fedavg.head": tasks[d]}).start() for d in ids]
    t.join(120)
    for a in agents:
        a.stop()
    assert result["state"] == "done" and len(result["rounds"]) == 3
    assert all(len(r["accepted"]) == 3 for r in result["rounds"])

    replay = FedAvgJob(FedAvgConfig(**cfg))
    for r in result["rounds"]:
        chosen = replay.next_participants(set(ids))
        assert chosen == sorted(r["accepted"])                         # same seeded sampling
        replay_round(replay, chosen, tasks)
    for k in ("weight", "bias"):
        np.testing.assert_allclose(job.params[k], replay.params[k], rtol=1e-6, atol=1e-7)
    assert not np.allclose(job.params["weight"], FedAvgJob(FedAvgConfig(**cfg)).params["weight"])   # it trained


def test_final_evaluation_sees_the_model_after_the_last_round(broker, tmp_path):
    """Evaluating after each contribution (the CLI's default) must not leave the last round's
    server step unevaluated: the reported final accuracy is the saved head's."""
    ids = [f"dev{i}" for i in range(4)]
    rng = np.random.default_rng(0)
    y_eval = rng.integers(0, C, 200)
    Z_eval = (rng.normal(size=(200, D)) + 2 * np.eye(C, D)[y_eval]).astype(np.float32)
    cfg = dict(job_id="ft-eval", num_classes=C, feature_dim=D, rounds=2, clients_per_round=2, round_timeout_s=30,
               local_epochs=3, batch_size=8, client_lr=0.05, expected_devices=4, seed=1)
    job = FedAvgJob(FedAvgConfig(**cfg))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path,
                            ServiceSettings(evaluate_every_contribution=True), enrolled=set(ids),
                            eval_set=(Z_eval, y_eval))
    result = {}
    t = threading.Thread(target=lambda: result.update(svc.run(timeout_s=120)), daemon=True)
    t.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fedavg.head": device_task(i)}).start()
              for i, d in enumerate(ids)]
    t.join(120)
    for a in agents:
        a.stop()
    assert result["state"] == "done"
    saved = np.load(tmp_path / "model.npz")
    expected = float(((Z_eval @ saved["weight"].T + saved["bias"]).argmax(1) == y_eval).mean())
    assert result["final"]["accuracy"] == expected and result["final"]["server_steps"] == 2
