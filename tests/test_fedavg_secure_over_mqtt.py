"""Secure FedAvg(M) over mosquitto: each round's head updates are summed under SecAgg, and the
head equals an in-process plain FedAvg replay of the same rounds over the devices in each sum.
A device whose trained head breaks the round's bound declines; the round goes on without it."""


import time

import numpy as np
import pytest
from ops_fleet import Features, RecordingService, in_memory_keys, replay_round, start_secure_fedavg_agents
from aggregator.service.settings import ServiceSettings

from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from edge_client.tasks.head_training import HeadTrainingTask
from protocols.payloads.secagg import SECURE_FEDAVG_KIND

D, C, N = 6, 3, 30
OUTLIER = "dev4"      # its features are huge: its trained head exceeds max_abs_param


def device_task(i, scale=1.0):
    rng = np.random.default_rng(7 + i)
    y = rng.integers(0, C, N)
    Z = (scale * (rng.normal(size=(N, D)) + 2 * np.eye(C, D)[y])).astype(np.float32)
    return HeadTrainingTask(Z, y, lambda b, s, w: Features(D))


@pytest.mark.parametrize("momentum,ring_bits", [(0.0, 64), (0.9, 64), (0.0, 32)],
                         ids=["fedavg", "fedavgm", "fedavg-ring32"])
def test_secure_fedavg_equals_plain_fedavg_over_the_summed_devices(broker, tmp_path, momentum, ring_bits):
    ids = [f"dev{i}" for i in range(6)]
    identities, agg, registry = in_memory_keys(ids)
    plain = dict(job_id="sft", num_classes=C, feature_dim=D, rounds=3, clients_per_round=5, round_timeout_s=60,
                 local_epochs=2, batch_size=8, client_lr=0.05, server_momentum=momentum, expected_devices=6, seed=4)
    # phases far longer than the test's wait: a member that declined is not waited for (it held
    # the group for the phase's timeout, every round the outlier was drawn into)
    job = SecureFedAvgJob(SecureFedAvgConfig(**plain, max_samples=100, max_abs_param=20.0, phase_timeout_s=120,
                                             ring_bits=ring_bits),
                          identity=agg, registry=registry)
    service = RecordingService(job, broker.url, tmp_path, set(ids), ServiceSettings(evaluate_every_contribution=False))
    tasks = {d: device_task(i, 1000.0 if d == OUTLIER else 1.0) for i, d in enumerate(ids)}
    agents = start_secure_fedavg_agents(broker.url, identities, agg.public_key_bytes, SECURE_FEDAVG_KIND, tasks)
    result = service.join(60)
    for a in agents:
        a.stop()
    assert result.get("state") == "done", result
    assert len(result["rounds"]) == 3 and not job.failed_rounds

    replay = FedAvgJob(FedAvgConfig(**plain, **PLAIN_MEAN))   # the plain mean a secure sum is
    outlier_sampled = False
    for r in result["rounds"]:
        chosen = replay.next_participants(set(ids))                  # same seeded sampling as the secure job
        in_sum = sorted(r["accepted"])
        outlier_sampled |= OUTLIER in chosen
        assert OUTLIER not in in_sum and set(in_sum) == set(chosen) - {OUTLIER}
        replay_round(replay, in_sum, tasks)
    assert outlier_sampled                                           # the decline path was exercised
    for k in ("weight", "bias"):
        np.testing.assert_allclose(job.params[k], replay.params[k], rtol=0, atol=1e-6)
    assert not np.allclose(job.params["weight"], FedAvgJob(FedAvgConfig(**plain)).params["weight"])   # it trained
    assert job.samples == sum(N for r in result["rounds"] for _ in r["accepted"])
    # no head ever reached the aggregator in the clear: only secagg messages and declines
    envelopes = service.received_envelopes()
    assert not any("weight" in env.tensors or "bias" in env.tensors for env in envelopes)
    types = {env.type for env in envelopes}
    assert "secagg" in types and "result" not in types
    # the masked inputs were words of the job's ring (a 32-bit ring: half the bytes)
    words = {env.tensors["masked_input"].dtype for env in envelopes if "masked_input" in env.tensors}
    assert words == {np.dtype({32: "<u4", 64: "<u8"}[ring_bits])}


CLOCK_AHEAD = "dev5"
SKEW_S = 3600.0         # past the task's 120 s and the device's 60 s grace: every task arrives expired


def test_a_device_whose_clock_runs_ahead_is_not_drawn_again_in_its_job(broker, tmp_path):
    """A device whose clock runs an hour ahead receives every task expired: it declines the job's
    first once, saying so, and skips the job's later tasks in silence (protocols/device_session.py).
    Drawn again, it was a member that never answered: each later round's first SecAgg phase waited
    its budget for it, at least half the round (aggregator/jobs/phase_clock.py: 54 s here). Its
    decline now stops the job drawing it; the later rounds close at their own pace."""
    ids = [f"dev{i}" for i in range(6)]
    identities, agg, registry = in_memory_keys(ids)
    job = SecureFedAvgJob(SecureFedAvgConfig(
        job_id="ahead", num_classes=C, feature_dim=D, rounds=3, clients_per_round=6, round_timeout_s=120,
        local_epochs=1, batch_size=8, client_lr=0.05, expected_devices=6, seed=4, max_samples=100,
        max_abs_param=20.0, phase_timeout_s=120), identity=agg, registry=registry)
    service = RecordingService(job, broker.url, tmp_path, set(ids), ServiceSettings(evaluate_every_contribution=False))
    tasks = {d: device_task(i) for i, d in enumerate(ids)}
    agents = start_secure_fedavg_agents(broker.url, identities, agg.public_key_bytes, SECURE_FEDAVG_KIND, tasks,
                                        clocks={CLOCK_AHEAD: lambda: time.time() + SKEW_S})
    result = service.join(50)           # before: the job was still waiting on it in round 2
    for a in agents:
        a.stop()
    assert result.get("state") == "done", result
    first, *later = result["rounds"]
    assert first["declined"] == [CLOCK_AHEAD] and sorted(first["accepted"]) == sorted(set(ids) - {CLOCK_AHEAD})
    assert first["clock_ahead"] == [CLOCK_AHEAD] and result["clock_ahead"] == [CLOCK_AHEAD]
    for r in later:     # never asked again: the other five, every one in the sum, without waiting
        assert sorted(r["accepted"]) == sorted(set(ids) - {CLOCK_AHEAD}) and not r["dropped"] + r["declined"], r
        assert r["closed_at"] - r["opened_at"] < 0.45 * 120, r
    ahead = next(a for a in agents if a.device_id == CLOCK_AHEAD)
    assert (ahead.stats.tasks_declined, ahead.stats.tasks_skipped) == (1, 0)      # no later task reached it
