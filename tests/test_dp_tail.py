"""DP for FedAvg of the backbone tail (FT(φ)) over mosquitto, with real device agents training
through the bundle's tail program: central DP (``fedavg-tail``) moves the tail by exactly the
devices' clipped deltas plus the job's Gaussian noise over κ, and distributed DP
(``fedavg-tail-secure``) by the clipped deltas plus the devices' Skellam shares, of the variance
the round's threshold promises; both report dp-accounting's own ε in results.json."""

import json
import math

import numpy as np
import pytest

from aggregator.jobs.fedavg_tail import TailFedAvgConfig, TailFedAvgJob
from aggregator.jobs.secure_fedavg import SecureTailFedAvgConfig, SecureTailFedAvgJob
from edge_client.agent import DeviceAgent
from edge_client.data import load_fashion_mnist
from edge_client.tasks.tail_training import TailTrainingTask
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fedavg import KIND_TAIL
from protocols.payloads.secagg import SECURE_TAIL_KIND
from protocols.secagg.config import default_threshold

from ops_fleet import RecordingService, in_memory_keys, start_secure_fedavg_agents
from aggregator.service.settings import ServiceSettings
from test_dp_mechanisms import variance_ratio_ok
from test_dp_over_mqtt import gaussian_epsilon

TAIL = "tail.stages.0.0.weight"          # FT(φ) of the 32 px MobileNetV2 bundle: the last stage's 1x1 conv


class RecordingTail:
    """The device's plain tail handler, keeping what it started from and what it trained (the
    test's plaintext reference; the aggregator only ever gets the result or a masked vector)."""

    def __init__(self, task):
        self.task, self.calls = task, []

    def __call__(self, params, tensors=None):
        body, trained = self.task(params, tensors)
        self.calls.append((np.asarray(tensors[TAIL], np.float64), np.asarray(trained[TAIL], np.float64)))
        return body, trained


def clipped(start, trained, clip_norm):
    delta = trained - start
    return delta * min(1.0, clip_norm / np.linalg.norm(delta))


def tail_config(bundle, **extra):
    return {**dict(num_classes=10, feature_dim=1280, rounds=2, local_epochs=1, batch_size=10, client_lr=0.05,
                   round_timeout_s=60, seed=1, train="tail", tail_stages=1, image_size=32, init="random",
                   tail_program_file=str(bundle.parent / "tail_eval.pt2")), **extra}


@pytest.fixture(scope="module")
def shards():
    images, labels = load_fashion_mnist("train")
    return [(images[i * 15:(i + 1) * 15], labels[i * 15:(i + 1) * 15].astype(np.int64)) for i in range(4)]


def test_central_dp_tail_moves_by_the_clipped_deltas_plus_the_stated_noise(broker, tail_bundle, shards, tmp_path):
    ids, z, C, population = ["t0", "t1", "t2"], 1.1, 0.02, 3
    job = TailFedAvgJob(TailFedAvgConfig(**tail_config(tail_bundle, job_id="dp-tail", clients_per_round=3,
                                                       expected_devices=3, dp_noise_multiplier=z, dp_clip_norm=C,
                                                       dp_population=population)))
    job.dp.rng = np.random.default_rng(11)        # seeded only here, to take the noise out exactly
    tasks = {d: RecordingTail(TailTrainingTask(*shards[i], tail_bundle)) for i, d in enumerate(ids)}
    service = RecordingService(job, broker.url, tmp_path, set(ids), ServiceSettings(evaluate_every_contribution=False))
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {KIND_TAIL: tasks[d]}).start() for d in ids]
    result = service.join(150)
    for a in agents:
        a.stop()
    assert result.get("state") == "done" and [len(r["accepted"]) for r in result["rounds"]] == [3, 3], result
    noise_rng = np.random.default_rng(11)         # the job draws one N(0, (zC)²) array per trained tensor
    residuals = []
    for t in range(2):
        starts = [tasks[d].calls[t][0] for d in ids]
        assert all(np.array_equal(s, starts[0]) for s in starts)          # every device got the same tail
        deltas = [clipped(*tasks[d].calls[t], C) for d in ids]
        norms = [np.linalg.norm(tasks[d].calls[t][1] - tasks[d].calls[t][0]) for d in ids]
        assert max(norms) > C and all(np.linalg.norm(x) <= C * (1 + 1e-9) for x in deltas)
        after = tasks[ids[0]].calls[1][0] if t == 0 else np.asarray(job.params[TAIL], np.float64)
        noise = noise_rng.normal(0.0, z * C, starts[0].shape)
        np.testing.assert_allclose(after, starts[0] + (sum(deltas) + noise) / 3, rtol=0, atol=2e-6)
        residuals.append(3 * (after - starts[0]) - sum(deltas))
    assert variance_ratio_ok(np.concatenate([r.ravel() for r in residuals]), (z * C) ** 2)
    saved = json.loads((tmp_path / "results.json").read_text())
    q = 3 / population
    assert saved["final"]["privacy"]["epsilon"] == gaussian_epsilon(z, 2, q, 1e-5)
    assert saved["final"]["privacy"]["releases"] == 2 and saved["final"]["privacy"]["clip_norm"] == C
    releases = [entry["privacy"]["releases"] for entry in saved["history"]]
    assert releases[-1] == 2 and releases == sorted(releases)
    for entry in saved["history"]:                 # ε after every round is the library's for the rounds so far
        privacy = entry["privacy"]
        assert privacy["epsilon"] == (gaussian_epsilon(z, privacy["releases"], q, 1e-5) if privacy["releases"] else 0)


def test_distributed_dp_tail_sums_clipped_deltas_and_noise_of_the_threshold_variance(broker, tail_bundle, shards,
                                                                                     tmp_path):
    ids, z, C = ["s0", "s1", "s2", "s3"], 0.9, 0.02
    identities, agg, registry = in_memory_keys(ids)
    cfg = SecureTailFedAvgConfig(**tail_config(tail_bundle, job_id="dp-tail-secure", rounds=1, clients_per_round=4,
                                               expected_devices=4, dp_noise_multiplier=z, dp_clip_norm=C),
                                 max_samples=100, max_abs_param=50.0, phase_timeout_s=5)
    job = SecureTailFedAvgJob(cfg, identity=agg, registry=registry)
    start = np.asarray(job.params[TAIL], np.float64)
    tasks = {d: RecordingTail(TailTrainingTask(*shards[i], tail_bundle)) for i, d in enumerate(ids)}
    service = RecordingService(job, broker.url, tmp_path, set(ids), ServiceSettings(evaluate_every_contribution=False))
    agents = start_secure_fedavg_agents(broker.url, identities, agg.public_key_bytes, SECURE_TAIL_KIND, tasks)
    result = service.join(150)
    for a in agents:
        a.stop()
    assert result.get("state") == "done" and sorted(result["rounds"][0]["accepted"]) == ids, result
    assert not job.failed_rounds
    deltas = [clipped(*tasks[d].calls[0], C) for d in ids]
    assert max(np.linalg.norm(c[1] - c[0]) for c in (tasks[d].calls[0] for d in ids)) > C
    noise = 4 * (np.asarray(job.params[TAIL], np.float64) - start) - sum(deltas)     # what the ring added
    threshold = default_threshold(4)
    device_stddev = z * C / math.sqrt(threshold)
    assert variance_ratio_ok(noise.ravel(), 4 * device_stddev ** 2) and 4 * device_stddev ** 2 >= (z * C) ** 2
    # no device's clipped delta leaks past the noise: each projection is within 6σ of the sum's noise
    for d in deltas:
        assert abs(float(np.vdot(noise, d / np.linalg.norm(d)))) < 6 * 2 * device_stddev
    privacy = json.loads((tmp_path / "results.json").read_text())["final"]["privacy"]
    assert privacy["epsilon"] == gaussian_epsilon(z, 1, 1.0, 1e-5) and privacy["releases"] == 1
