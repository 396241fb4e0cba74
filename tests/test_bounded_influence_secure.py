"""Bounded influence under secure aggregation (issue #26): the server sees only each group's sum,
so it checks that sum against the sum of its members' bounds (Σ n_k·F² on diag A). A group whose
sum breaks it (one member's features ten times the backbone's range, on a single sample) is
discarded and reported; the other group's sum is applied exactly. Real agents over mosquitto."""

import numpy as np
from ops_fleet import Features, RecordingService, in_memory_keys
from aggregator.service.settings import ServiceSettings

from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from edge_client.agent import DeviceAgent
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from edge_client.tasks.secure_fed3r import SecureFed3R
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.secagg import SECAGG_TYPE, SYNC_KIND

from test_fed3r_sync_over_mqtt import C, D, device_data

ATTACKER = "dev2"


def attacker_data():
    """One sample whose features are almost 10 x F: within SecAgg's per-entry range (max_samples·F²,
    the range a device with max_samples samples could reach), far beyond n·F² for its n = 1."""
    return np.full((1, D), 59.0, dtype=np.float32), np.zeros(1, dtype=np.int64)


def test_a_group_whose_sum_breaks_its_bound_is_discarded_and_the_other_is_exact(broker, tmp_path):
    ids = [f"dev{i}" for i in range(8)]
    identities, agg, registry = in_memory_keys(ids)
    cfg = Fed3RSyncConfig(job_id="sync", num_classes=C, feature_dim=D, clients_per_round=4, expected_devices=8,
                          round_timeout_s=60, phase_timeout_s=3, max_samples=100, max_attempts=1)
    job = Fed3RSyncJob(cfg, identity=agg, registry=registry)
    service = RecordingService(job, broker.url, tmp_path, set(ids), timeout_s=120)
    agents = []
    for i, d in enumerate(ids):
        imgs, labels = attacker_data() if d == ATTACKER else device_data(i)
        handler = SecureFed3R(identities[d], agg.public_key_bytes, Fed3RStatsTask(imgs, labels, lambda b, s, w: Features(D)))
        agents.append(DeviceAgent(d, BrokerConfig.from_url(broker.url), {},
                                  protocol_handlers={SYNC_KIND: handler, SECAGG_TYPE: handler}).start())
    result = service.join(120)
    for a in agents:
        a.stop()
    assert result.get("state") == "done", result
    # the attacker's group: discarded and reported, nothing of it applied
    assert len(job.failed_rounds) == 1 and "out of bound" in job.failed_rounds[0][1], job.failed_rounds
    applied = sorted(result["contributed"])
    assert len(applied) == 4 and ATTACKER not in applied
    # the other group's sum: the plain numpy sum of its members' statistics (to the fixed-point resolution)
    A = np.zeros((D + 1, D + 1))
    for d in applied:
        Z = np.hstack([device_data(ids.index(d))[0].astype(np.float64), np.ones((40, 1))])
        A += Z.T @ Z
    np.testing.assert_allclose(job.strategy.A.numpy(), A, rtol=0, atol=1e-6)
    assert job.strategy.n_samples == 40 * len(applied)


# ---------------------------------------------------------------- FedAvg: clipped before masking
def test_secure_fedavg_discards_a_group_whose_sum_breaks_n_times_c_and_the_others_are_exact(broker, tmp_path):
    from ops_fleet import replay_round

    from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
    from aggregator.jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob
    from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining
    from edge_client.tasks.secure_update import SecAggSessions
    from protocols.payloads.secagg import SECURE_FEDAVG_KIND
    from test_fedavg_secure_over_mqtt import device_task

    class Unclipped(SecureFedAvgTraining):
        """Modified device code: it skips the clipping and sends 1000 times its update."""

        @staticmethod
        def clipped_delta(dp, trained, start):
            return {k: 1000.0 * (np.asarray(v, np.float64) - np.asarray(start[k], np.float64)) for k, v in trained.items()}

    ids = [f"dev{i}" for i in range(6)]
    identities, agg, registry = in_memory_keys(ids)
    plain = dict(job_id="sfb", num_classes=3, feature_dim=6, rounds=4, clients_per_round=3, round_timeout_s=60,
                 local_epochs=2, batch_size=8, client_lr=0.05, expected_devices=6, seed=1, **PLAIN_MEAN)
    job = SecureFedAvgJob(SecureFedAvgConfig(**plain, max_samples=100, max_abs_param=1e4, phase_timeout_s=3,
                                             update_clip_norm=5.0), identity=agg, registry=registry)
    service = RecordingService(job, broker.url, tmp_path, set(ids), ServiceSettings(evaluate_every_contribution=False))
    tasks = {d: device_task(i) for i, d in enumerate(ids)}
    agents = []
    for d in ids:
        sessions = SecAggSessions(d)
        cls = Unclipped if d == ATTACKER else SecureFedAvgTraining
        agents.append(DeviceAgent(d, BrokerConfig.from_url(broker.url), {}, protocol_handlers={
            SECURE_FEDAVG_KIND: cls(identities[d], agg.public_key_bytes, tasks[d], sessions),
            SECAGG_TYPE: sessions}).start())
    result = service.join(150)
    for a in agents:
        a.stop()
    assert result.get("state") == "done", result

    replay = FedAvgJob(FedAvgConfig(**plain))
    discarded = {r for r, reason in job.failed_rounds if "out of bound" in reason}
    for r in result["rounds"]:
        chosen = replay.next_participants(set(ids))                  # the secure job's seeded sampling
        in_sum = sorted(r["accepted"])
        assert (ATTACKER in chosen) == (r["round"] in discarded) == (in_sum == [])
        replay_round(replay, in_sum if in_sum else [], tasks)
    assert discarded and len(discarded) < len(result["rounds"])     # both paths were exercised
    for k in ("weight", "bias"):
        np.testing.assert_allclose(job.params[k], replay.params[k], rtol=0, atol=1e-6)
