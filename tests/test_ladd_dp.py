"""DP for LADD against numpy references. Central: each device's joint delta (its φ and its
cluster's θ together) is clipped to C, every released slot gets N(0, (zC)²) noise over the
selected counts, the job's ε is dp-accounting's own for (z, training rounds, q), and a LADD job
refuses to start (HTTP 422 through the admin API) or stops when its budget would be exceeded.
Distributed (ladd-secure): devices clip the same way and add their Skellam share in the ring,
through a real SecAgg round with a dropout."""

import json

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp
from scipy import stats
from starlette.testclient import TestClient

from aggregator.api.app import create_app
from aggregator.jobs.ladd import LaddConfig, LaddJob, save_initial_model
from aggregator.jobs.registry import build_job
from aggregator.jobs.secure_ladd import SecureLaddConfig, SecureLaddJob
from edge_client.agent import DeviceAgent
from edge_client.tasks.ladd_training import TrainedUpdate
from edge_client.tasks.secure_ladd_training import SecureLaddTraining
from protocols.files import file_sha256
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.ladd import encode_update, make_layout, parse_train_task, unpack
from protocols.payloads.secagg import SECURE_LADD_KIND, ClusterSlotLayout
from protocols.rounds import RoundClosed
from protocols.secagg import AggregateReady, Phase
from protocols.secagg.driver import run_round

from ops_fleet import RecordingService, in_memory_keys
from aggregator.service.settings import ServiceSettings
from test_admin_api import AUTH, TOKEN, start_service
from test_dp_accounting import check_rounds_sample_at_most_the_accounted_rate
from test_dp_mechanisms import variance_ratio_ok
from test_ladd_aggregation import DEVICES, INITIAL, TRAINABLE, run_style_round, send

SEG = {"num_classes": 5, "image_size": 64}
THETA = ["head.conv.weight", "head.classifier.bias"]        # trainable and cluster-specific ("head" scope)


def library_epsilon(z, rounds, q, delta=1e-5):
    """The library's own number, built here without aggregator.compute.privacy."""
    accountant = rdp.RdpAccountant()
    event = dp_accounting.GaussianDpEvent(z)
    accountant.compose(event if q == 1 else dp_accounting.PoissonSampledDpEvent(q, event), rounds)
    return accountant.get_epsilon(delta)


def dp_job(**over):
    cfg = dict(model=SEG, rounds=3, clients_per_round=6, k_min=2, k_max=4, kd_lambda=0.0, seed=3,
               dp_noise_multiplier=1.0, dp_clip_norm=0.5)
    return LaddJob(LaddConfig(**{**cfg, **over}), initial=(INITIAL, TRAINABLE))


def delta_of_norm(norm, rng):
    """A random joint delta over the trainable tensors with exactly this L2 norm."""
    d = {k: rng.normal(size=INITIAL[k].shape) for k in TRAINABLE}
    scale = norm / np.sqrt(sum(np.sum(v ** 2) for v in d.values()))
    return {k: v * scale for k, v in d.items()}


def test_dp_ladd_round_is_the_jointly_clipped_mean_over_the_selected():
    rng = np.random.default_rng(7)
    C = 0.5
    job = dp_job(dp_noise_multiplier=1e-12, dp_clip_norm=C)       # noise isolated: ~1e-13
    run_style_round(job, set(DEVICES))
    labels = job.assignment
    phi0 = {k: v.astype(np.float64) for k, v in job.phi.items()}
    theta0 = {c: {k: v.astype(np.float64) for k, v in p.items()} for c, p in job.theta.items()}
    parts = job.next_participants(set(DEVICES))
    assert len(parts) == 6
    answered = parts[:-1]                           # the last one drops: the denominators stay the selected
    norms = [0.05, 0.3, 2.0, 40.0, 1e4][:len(answered)]
    deltas = {d: delta_of_norm(n, rng) for d, n in zip(answered, norms)}
    layout = make_layout(INITIAL, TRAINABLE)
    for d in answered:
        start = job.cluster_model(labels[d])
        trained = {k: (start[k] + deltas[d][k]).astype(np.float32) for k in TRAINABLE}
        deltas[d] = {k: trained[k].astype(np.float64) - start[k].astype(np.float64) for k in TRAINABLE}
        body, tensors = encode_update(trained, layout, int(rng.integers(1, 50)), labels[d])
        job.apply(d, send(job, d, "ladd.train", body, tensors))
    job.close_round(RoundClosed(job.round, tuple(answered), (parts[-1],), (), ()))
    # reference: plain numpy, each device's whole delta scaled to norm <= C, sums over the selected
    clipped = {}
    for d, delta in deltas.items():
        flat = np.concatenate([delta[k].ravel() for k in TRAINABLE])
        factor = min(1.0, C / np.linalg.norm(flat))
        clipped[d] = {k: v * factor for k, v in delta.items()}
        assert np.sqrt(sum(np.sum(v ** 2) for v in clipped[d].values())) <= C * (1 + 1e-12)
    selected = {c: sum(labels[d] == c for d in parts) for c in range(job.n_clusters)}
    expected_phi = phi0["tail.conv.weight"] + sum(clipped[d]["tail.conv.weight"] for d in answered) / len(parts)
    np.testing.assert_allclose(job.phi["tail.conv.weight"], expected_phi, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(job.phi["tail.bn.running_mean"], phi0["tail.bn.running_mean"].astype(np.float32))
    for c, m_c in selected.items():
        for name in job.theta[c]:
            if m_c == 0 or name not in THETA:      # no device selected / frozen: kept exactly
                np.testing.assert_array_equal(job.theta[c][name], theta0[c][name].astype(np.float32))
                continue
            mine = [clipped[d][name] for d in answered if labels[d] == c]
            np.testing.assert_allclose(job.theta[c][name], theta0[c][name] + sum(mine, 0.0) / m_c,
                                       rtol=1e-6, atol=1e-7)


def test_dp_ladd_rounds_sample_no_device_more_often_than_its_epsilon_counts():
    """As DP FedAvg's (test_dp_accounting.py): a declared dp_population larger than the devices
    online no longer puts each of them in every round while ε counts q = κ / population."""
    make = lambda: dp_job(clustering="none", clients_per_round=10, dp_population=1000, rounds=10 ** 6)   # noqa: E731
    check_rounds_sample_at_most_the_accounted_rate(make, 10, 1000, rounds=100)


def test_dp_ladd_noise_has_the_scale_its_epsilon_assumes():
    """Rounds nobody answers release pure noise: N(0, (zC/m)²) on φ and N(0, (zC/m_c)²) on every
    selected cluster's θ_c; ε after them is the library's for (z, rounds, q = κ/population)."""
    z, C, kappa, population = 1.3, 0.7, 6, len(DEVICES)
    job = dp_job(dp_noise_multiplier=z, dp_clip_norm=C, dp_population=population, rounds=4)
    job.dp.rng = np.random.default_rng(1)
    run_style_round(job, set(DEVICES))
    assert job.evaluate(None, None)["privacy"]["releases"] == 0        # the style round releases nothing
    phi_noise, theta_noise = [], []
    for _ in range(4):
        phi0 = job.phi["tail.conv.weight"].astype(np.float64)
        theta0 = {c: {k: p[k].astype(np.float64) for k in THETA} for c, p in job.theta.items()}
        parts = job.next_participants(set(DEVICES))
        selected = {c: sum(job.assignment[d] == c for d in parts) for c in job.theta}
        job.close_round(RoundClosed(job.round, (), tuple(parts), (), ()))
        phi_noise.append((job.phi["tail.conv.weight"] - phi0).ravel() * kappa / (z * C))
        for c, m_c in selected.items():
            moved = np.concatenate([(job.theta[c][k] - theta0[c][k]).ravel() for k in THETA])
            if m_c:
                theta_noise.append(moved * m_c / (z * C))
            else:
                assert not moved.any()
    for noise in (np.concatenate(phi_noise), np.concatenate(theta_noise)):
        lo, hi = stats.chi2.ppf([1e-6, 1 - 1e-6], noise.size) / noise.size
        assert lo < np.mean(noise ** 2) < hi
    report = job.evaluate(None, None)["privacy"]
    assert report["releases"] == 4 and report["sampling_rate"] == kappa / population
    assert report["epsilon"] == pytest.approx(library_epsilon(z, 4, kappa / population), rel=1e-12)
    assert report["clip_norm"] == C and job.finished(set(DEVICES), set(DEVICES))


def test_dp_ladd_stops_at_its_budget_and_adaptive_clip_survives_a_checkpoint():
    z, population, target = 2.0, len(DEVICES), 2.0
    job = dp_job(clustering="none", rounds=1000, clients_per_round=3, dp_noise_multiplier=z,
                 dp_population=population, dp_target_epsilon=target, dp_adaptive_clip=True)
    online = set(DEVICES)
    while parts := job.next_participants(online):
        job.close_round(RoundClosed(job.round, (), tuple(parts), (), ()))
    rounds = job.train_round
    q = 3 / population
    assert library_epsilon(z, rounds, q) <= target < library_epsilon(z, rounds + 1, q)
    assert job.finished(online, online) and rounds < 1000
    report = job.evaluate(None, None)["privacy"]
    assert report["budget_exhausted"] and report["epsilon"] == library_epsilon(z, rounds, q)
    assert report["clip_norm"] != 0.5          # adaptive: the noisy clipped count moved C
    restored = dp_job(clustering="none", rounds=1000, clients_per_round=3, dp_noise_multiplier=z,
                      dp_population=population, dp_target_epsilon=target, dp_adaptive_clip=True)
    restored.load_state_dict(job.state_dict())
    assert restored.dp.clip.value == report["clip_norm"] and restored.dp.releases == rounds
    assert restored.evaluate(None, None)["privacy"] == report


def test_dp_ladd_refuses_bad_updates_without_changing_the_round():
    job = dp_job(clustering="none", clients_per_round=2)
    parts = job.next_participants(set(DEVICES))
    agg = job._agg
    with pytest.raises(ValueError, match="no device selected"):
        agg.add(3, {k: INITIAL[k] for k in TRAINABLE}, 1, device=parts[0])
    with pytest.raises(ValueError, match="NaN"):
        agg.add(0, {**{k: INITIAL[k] for k in TRAINABLE}, "head.conv.weight": np.full((5, 4), np.inf)}, 1,
                device=parts[0])
    with pytest.raises(ValueError, match="slot"):
        agg.add(0, {"head.conv.weight": np.zeros((4, 5))}, 1, device=parts[0])
    with pytest.raises(ValueError, match="once, by its id"):
        agg.add(0, {k: INITIAL[k] for k in TRAINABLE}, 1)
    assert agg.count == 0 and not agg.updates
    assert len(parts) == 2


def test_ladd_over_budget_is_refused_at_creation_and_by_the_admin_api(broker, tmp_path):
    with pytest.raises(ValueError, match="privacy budget"):
        LaddConfig(model=SEG, dp_noise_multiplier=0.5, dp_target_epsilon=1.0)
    with pytest.raises(ValueError, match="dp_count_stddev"):
        LaddConfig(model=SEG, dp_noise_multiplier=3.0, dp_adaptive_clip=True, dp_count_stddev=1.0)
    path = tmp_path / "pretrained.npz"
    save_initial_model(path, INITIAL, TRAINABLE)
    base = {"model": SEG, "clustering": "none", "initial_model_file": str(path),
            "initial_model_sha256": file_sha256(path), "dp_noise_multiplier": 0.5}
    assert build_job("ladd", base).dp is not None
    svc, store, thread = start_service(broker, tmp_path, ["ghost"], expected_devices=1)
    try:
        client = TestClient(create_app(store, TOKEN, svc))
        for kind in ("ladd", "ladd-secure"):
            over = client.post("/api/jobs", headers=AUTH, json={"job_id": f"dp-{kind}", "kind": kind,
                                                                 "config": {**base, "dp_target_epsilon": 1.0}})
            assert over.status_code == 422 and "privacy budget" in over.text, over.text
            assert store.job(f"dp-{kind}") is None
        ok = client.post("/api/jobs", headers=AUTH, json={"job_id": "dp-ok", "kind": "ladd",
                                                          "config": {**base, "dp_target_epsilon": 50.0}})
        assert ok.status_code == 201 and store.job("dp-ok")["config"]["dp_noise_multiplier"] == 0.5
    finally:
        svc.stop()
        thread.join(30)


# ----------------------------------------------------------------------------- distributed DP (ladd-secure)
class KnownUpdate:
    """Stands in for the device's LaddTrainTask: the trained model is the task's model plus a fixed delta."""

    def __init__(self, delta):
        self.delta = delta

    def train(self, params, tensors):
        layout, flats = parse_train_task(params, tensors)
        start = unpack(flats["model"], layout)
        arrays = {k: (start[k] + self.delta[k]).astype(np.float32) for k in TRAINABLE}
        return TrainedUpdate(arrays, make_layout(INITIAL, TRAINABLE), 5, params["cluster"], "", {})


def test_secure_ladd_devices_clip_and_noise_in_the_ring_and_the_server_means_over_the_selected():
    z, C = 1.2, 0.5
    identities, agg, registry = in_memory_keys(DEVICES)
    cfg = SecureLaddConfig(model=SEG, rounds=1, clients_per_round=9, k_min=2, k_max=4, kd_lambda=0.0, seed=3,
                           dp_noise_multiplier=z, dp_clip_norm=C)
    job = SecureLaddJob(cfg, initial=(INITIAL, TRAINABLE), identity=agg, registry=registry)
    assert job.dp is None                           # no central noise: the devices add it
    run_style_round(job, set(DEVICES))
    labels = job.assignment
    chosen = job.next_participants(set(DEVICES))
    assert job.kind == SECURE_LADD_KIND and len(chosen) == 9
    phi0 = {k: v.astype(np.float64) for k, v in job.phi.items()}
    theta0 = {c: {k: v.astype(np.float64) for k, v in p.items()} for c, p in job.theta.items()}
    rng = np.random.default_rng(5)
    norms = dict(zip(chosen, [0.01, 0.2, 0.49, 0.8, 3.0, 10.0, 50.0, 1e3, 0.3]))
    devices = {d: SecureLaddTraining(identities[d], agg.public_key_bytes, KnownUpdate(delta_of_norm(norms[d], rng)),
                                     noise_rng=np.random.default_rng(100 + i)) for i, d in enumerate(chosen)}
    vectors = {d: devices[d].vector(*job.task_for(d)) for d in chosen}
    params = job.task_for(chosen[0])[0]
    dp, slots, config = params["dp"], ClusterSlotLayout.from_json(params["slots"]), job.secure.config
    assert all(slots.enabled) and dp["clip_norm"] == C and config.scale_bits == dp["scale_bits"]
    assert dp["stddev"] == pytest.approx(z * C / np.sqrt(config.threshold))
    # device side against numpy: the joint delta clipped to C, weight 1, plus noise only on the tensors
    residual = []
    for d in chosen:
        start = {**job.phi, **job.theta[labels[d]]}
        delta = {k: devices[d].last.arrays[k].astype(np.float64) - start[k].astype(np.float64) for k in TRAINABLE}
        factor = min(1.0, C / np.sqrt(sum(np.sum(v ** 2) for v in delta.values())))
        reference = slots.pack({k: v * factor for k, v in delta.items()}, 1, labels[d])
        assert np.array_equal(vectors[d][slots.tensors_size:], reference[slots.tensors_size:])   # counts exact
        residual.append(vectors[d][:slots.tensors_size] - reference[:slots.tensors_size])
    assert variance_ratio_ok(np.concatenate(residual), dp["stddev"] ** 2)
    # one device drops after the key exchange: the sum of the survivors still has noise ≥ (zC)²
    dropped = next(d for d in chosen if labels[d] == labels[chosen[0]])
    run = run_round(config, agg, {d: identities[d] for d in chosen}, vectors, dropouts={dropped: Phase.MASKED_INPUT})
    assert isinstance(run.outcome, AggregateReady)
    survivors = tuple(sorted(run.outcome.survivors))
    total = run.outcome.decode()
    assert np.array_equal(total, np.sum([vectors[d] for d in survivors], axis=0))
    assert len(survivors) * dp["stddev"] ** 2 >= (z * C) ** 2 * (1 - 1e-12)
    job.on_secure_sum(total, survivors)
    job.close_round(RoundClosed(job.round, survivors, (dropped,), (), ()))
    sums = slots.unpack_sum(total)
    np.testing.assert_allclose(job.phi["tail.conv.weight"], phi0["tail.conv.weight"] + sums.phi["tail.conv.weight"] / 9,
                               rtol=1e-6, atol=1e-6)
    for c in job.theta:                              # every slot over its 3 selected devices, dropout or not
        for name in THETA:
            np.testing.assert_allclose(job.theta[c][name], theta0[c][name] + sums.theta[c][name] / 3,
                                       rtol=1e-6, atol=1e-6)
    report = job.evaluate(None, None)["privacy"]
    assert report["releases"] == 1 and report["epsilon"] == pytest.approx(library_epsilon(z, 1, 1.0), rel=1e-12)
    with pytest.raises(ValueError, match="adaptive"):
        SecureLaddConfig(model=SEG, dp_noise_multiplier=z, dp_adaptive_clip=True)


@pytest.mark.parametrize("kind", ["fedavg-secure", "ladd-secure"])
def test_distributed_dp_claims_no_amplification_by_the_servers_own_sampling(kind):
    """A review's finding: a secure DP job took dp_population and reported ε amplified by sampling
    (q = κ / dp_population); distributed DP guards against the server, and the server draws the
    sample. Refused with the reason; without it the job builds (q = 1)."""
    from aggregator.jobs.secure_fedavg import SecureFedAvgConfig

    make = (lambda **f: SecureLaddConfig(model=SEG, **f)) if kind == "ladd-secure" else \
        (lambda **f: SecureFedAvgConfig(num_classes=3, feature_dim=4, max_samples=100, **f))
    with pytest.raises(ValueError, match="dp_population must be 0 under secure aggregation"):
        make(dp_noise_multiplier=1.0, dp_population=1000)
    assert make(dp_noise_multiplier=1.0).sampling_rate() == 1.0


# ----------------------------------------------------------------------------- over mosquitto
class FixedStep:
    """A device's ``ladd.train`` handler standing in for local self-training (the segmentation
    network is not what this test is about): it answers w_c + its own fixed step, recording w_c."""

    def __init__(self, step):
        self.step, self.starts = step, []

    def __call__(self, params, tensors=None):
        layout, flats = parse_train_task(params, tensors)
        start = unpack(flats["model"], layout)
        self.starts.append({k: start[k].astype(np.float64) for k in TRAINABLE})
        trained = {k: (start[k] + self.step[k]).astype(np.float32) for k in params["trainable"]}
        return encode_update(trained, make_layout(start, params["trainable"]), 5, params["cluster"])


def test_dp_ladd_over_mosquitto_reports_the_libraries_epsilon_and_stops_at_its_budget(broker, tmp_path):
    ids, z, C, population, target = ["l0", "l1", "l2"], 3.0, 0.1, 3, 3.2
    job = dp_job(job_id="dp-ladd", clustering="none", rounds=50, clients_per_round=3, expected_devices=3,
                 round_timeout_s=30, dp_noise_multiplier=z, dp_clip_norm=C, dp_population=population,
                 dp_target_epsilon=target)
    job.dp.rng = np.random.default_rng(21)          # seeded only here, to take the noise out exactly
    rng = np.random.default_rng(4)
    handlers = {d: FixedStep(delta_of_norm(norm, rng)) for d, norm in zip(ids, (0.05, 0.4, 3.0))}
    service = RecordingService(job, broker.url, tmp_path, set(ids), ServiceSettings(evaluate_every_contribution=False))
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"ladd.train": handlers[d]}).start() for d in ids]
    result = service.join(120)
    for a in agents:
        a.stop()
    q = 3 / population
    rounds = len(result["rounds"])
    assert result.get("state") == "done" and rounds == 4, result          # ε(4) = 2.99 <= 3.2 < ε(5)
    assert library_epsilon(z, rounds, q) <= target < library_epsilon(z, rounds + 1, q)
    assert all(len(r["accepted"]) == 3 for r in result["rounds"])
    # every round: the model moved by the clipped steps (over the 3 selected) plus the seeded noise
    noise_rng = np.random.default_rng(21)           # one N(0, (zC)²) array per trained tensor, in layout order
    models = [h.starts for h in handlers.values()]
    final = {k: np.asarray(job.cluster_model(0)[k], np.float64) for k in TRAINABLE}
    for t in range(rounds):
        start, after = models[0][t], (models[0][t + 1] if t + 1 < rounds else final)
        assert all(all(np.array_equal(m[t][k], start[k]) for k in TRAINABLE) for m in models)
        clipped_sum = {k: 0.0 for k in TRAINABLE}
        for h in handlers.values():
            delta = {k: (start[k] + h.step[k]).astype(np.float32).astype(np.float64) - start[k] for k in TRAINABLE}
            factor = min(1.0, C / np.sqrt(sum(np.sum(v ** 2) for v in delta.values())))
            clipped_sum = {k: clipped_sum[k] + factor * delta[k] for k in TRAINABLE}
        for k in TRAINABLE:
            noise = noise_rng.normal(0.0, z * C, start[k].shape)
            np.testing.assert_allclose(after[k], start[k] + (clipped_sum[k] + noise) / 3, rtol=0, atol=1e-6)
    saved = json.loads((tmp_path / "results.json").read_text())
    privacy = saved["final"]["privacy"]
    assert privacy["epsilon"] == library_epsilon(z, rounds, q) and privacy["budget_exhausted"]
    assert privacy["releases"] == rounds and privacy["clip_norm"] == C
    for entry in saved["history"]:                   # ε after every round is the library's for the rounds so far
        p = entry["privacy"]
        assert p["epsilon"] == (library_epsilon(z, p["releases"], q) if p["releases"] else 0)
