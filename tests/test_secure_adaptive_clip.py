"""Adaptive clipping (Andrew et al. 2021) under secure aggregation with distributed DP.

Each device of a ``fedavg-secure`` round with ``dp_adaptive_clip`` puts its centred clipped-indicator
bit (b_k − ½)·s before its vector's count entry, noised with its Skellam share like the update
(s = σ/σ_b, the task's ``dp.clip_bit_scale``); the aggregator reads Σ (b_k − ½) + noise from the
unmasked sum's bit entry over s and moves C by the plain rule. Checked: the scale gives the count
the noise stddev σ_b the accountant assumes and the joint release the job's z; the count read and
the C it gives against an independent numpy computation of the devices' bits and noise draws; a
forged bit entry beyond what the group's bits can sum to is discarded (C kept); over mosquitto,
the C sequence and the model against a plain (central) adaptive DP-FedAvg replay of the same rounds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from ops_fleet import Features, RecordingService, in_memory_keys, replay_round, start_secure_fedavg_agents

from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob
from aggregator.service.settings import ServiceSettings
from edge_client.tasks.head_training import HeadTrainingTask
from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining
from protocols.payloads.secagg import SECURE_FEDAVG_KIND
from protocols.rounds import RoundClosed
from protocols.secagg import AggregateReady
from protocols.secagg.distributed_dp import add_skellam_noise, noisy_bound
from protocols.secagg.driver import run_round

Z_DP, CLIP, KAPPA, QUANTILE, LR = 1.0, 0.5, 6, 0.5, 0.2


class Step:
    """A device whose update adds ``size`` to every entry it was sent: ‖Δ‖ = size·√entries."""

    def __init__(self, size: float):
        self.size = size

    def __call__(self, params, tensors):
        return {"n": 10}, {k: v + np.float32(self.size) for k, v in tensors.items()}


def adaptive_job(ids, agg, registry, **fields) -> SecureFedAvgJob:
    config = SecureFedAvgConfig(num_classes=3, feature_dim=4, rounds=3, clients_per_round=KAPPA, seed=1,
                                dp_noise_multiplier=Z_DP, dp_clip_norm=CLIP, dp_adaptive_clip=True,
                                dp_target_quantile=QUANTILE, dp_clip_lr=LR, **fields)
    return SecureFedAvgJob(config, identity=agg, registry=registry)


def test_the_bit_entry_gives_the_count_the_noise_the_accountant_assumes():
    """s = σ/σ_b with σ = z_Δ·C (Andrew et al.'s split): t members' noise on the bit entry, over s,
    has stddev σ_b (measured on Skellam draws), and the update (sensitivity C) with the bit
    (sensitivity s/2) under σ per entry is one Gaussian release of multiplier z, what is charged."""
    ids = [f"dev{i}" for i in range(KAPPA)]
    identities, agg, registry = in_memory_keys(ids)
    job = adaptive_job(ids, agg, registry)
    chosen = job.next_participants(set(ids))
    params, _ = job.task_for(chosen[0])
    dp, sigma_b = params["dp"], max(KAPPA / 20, Z_DP)            # count_stddev's default
    z_update = (Z_DP ** -2 - (2 * sigma_b) ** -2) ** -0.5         # their Eq. 4, by hand
    sigma = z_update * CLIP
    t = dp["threshold"]
    assert dp["clip_norm"] == CLIP and dp["stddev"] == pytest.approx(sigma / math.sqrt(t))
    assert dp["clip_bit_scale"] == pytest.approx(sigma / sigma_b)
    assert job.vector_length == 3 * 4 + 3 + 2                    # [Δ | bit | 1]
    s = dp["clip_bit_scale"]
    assert sigma / math.sqrt(CLIP ** 2 + (s / 2) ** 2) == pytest.approx(Z_DP)   # one release at multiplier z
    draws = sum(add_skellam_noise(np.zeros(40_000), dp["stddev"], dp["scale_bits"], np.random.default_rng(i))
                for i in range(t)) / s
    assert np.std(draws) == pytest.approx(sigma_b, rel=0.02)
    assert job.evaluate(None, None)["privacy"]["noise_multiplier"] == Z_DP


def device_noise(seed: int, length: int, dp: dict) -> np.ndarray:
    """The Skellam share a device seeded with ``seed`` adds to the first length − 1 entries of its
    vector, drawn here by numpy as distributed_dp documents it (two Poisson(μ) draws, μ = (σ_dev 2^f)²/2)."""
    rng = np.random.default_rng(seed)
    mu = (dp["stddev"] * 2.0 ** dp["scale_bits"]) ** 2 / 2
    return (rng.poisson(mu, length - 1) - rng.poisson(mu, length - 1)) * 2.0 ** -dp["scale_bits"]


def run_group(job, identities, agg, chosen, steps):
    """One secure round of ``chosen`` (device i's update: ``steps[i]`` on every entry, its noise
    seeded with i): (the unmasked sum, survivors, the round's dp params, the vectors)."""
    dp = job.task_for(chosen[0])[0]["dp"]
    devices = {d: SecureFedAvgTraining(identities[d], agg.public_key_bytes, Step(steps[i]),
                                       noise_rng=np.random.default_rng(i)) for i, d in enumerate(chosen)}
    vectors = {d: devices[d].vector(*job.task_for(d)) for d in chosen}
    run = run_round(job.secure.config, agg, {d: identities[d] for d in chosen}, vectors)
    assert isinstance(run.outcome, AggregateReady)
    return run.outcome.decode(), tuple(sorted(run.outcome.survivors)), dp, vectors


def test_the_noisy_count_is_read_from_the_sums_bit_entry_and_moves_c_by_the_plain_rule():
    """Devices with updates within C (b = 1) and beyond it (b = 0): the sum's bit entry over s is
    Σ (b_k − ½) plus the devices' noise on that entry (their draws recomputed here), and C moves
    to C·exp(−η(count/κ + ½ − γ)); the next round's task carries that C and its noise."""
    ids = [f"dev{i}" for i in range(KAPPA)]
    identities, agg, registry = in_memory_keys(ids)
    job = adaptive_job(ids, agg, registry)
    chosen = job.next_participants(set(ids))
    steps = [0.01, 1.0, 0.01, 1.0, 1.0, 0.01]                    # ‖Δ‖ = 0.039 ≤ C or 3.9 > C
    total, survivors, dp, vectors = run_group(job, identities, agg, chosen, steps)
    s, f, length = dp["clip_bit_scale"], dp["scale_bits"], job.vector_length
    bits = [1 if step * math.sqrt(15) <= CLIP else 0 for step in steps]
    noise = sum(device_noise(i, length, dp)[-1] for i in range(len(chosen)))      # each share's bit entry
    rounded = sum(np.rint((b - 0.5) * s * 2.0 ** f) * 2.0 ** -f for b in bits)
    count = (rounded + noise) / s
    assert bits.count(1) == 3 and abs(count) > 1e-3               # the noise is in the count
    assert total[-1] == len(chosen) and total[-2] / s == pytest.approx(count, rel=1e-9, abs=1e-9)
    bias_before = job.params["bias"].astype(np.float64)
    job.on_secure_sum(total, survivors)
    job.close_round(RoundClosed(job.round, survivors, (), (), ()))
    expected_c = CLIP * math.exp(-LR * (count / KAPPA + 0.5 - QUANTILE))
    assert job.dp.clip.value == pytest.approx(expected_c, rel=1e-9)
    assert job.evaluate(None, None)["privacy"]["clip_norm"] == job.dp.clip.value
    # the update part is read as before: the bias moves by its entries of the sum over κ
    np.testing.assert_allclose(job.params["bias"] - bias_before, total[-5:-2] / KAPPA, rtol=1e-5, atol=1e-6)
    assert job.next_participants(set(ids))                        # round 2 runs at the new C
    dp2 = job.task_for(chosen[0])[0]["dp"]
    assert dp2["clip_norm"] == pytest.approx(expected_c)
    assert dp2["clip_bit_scale"] == pytest.approx(dp["clip_bit_scale"] * expected_c / CLIP)


@pytest.mark.parametrize("forged_count", [KAPPA * 3.0, -KAPPA * 3.0, 1e6])
def test_a_forged_bit_entry_beyond_what_the_group_can_sum_is_discarded_and_c_kept(forged_count):
    """A modified member may mask any ring element, and the server sees only the sum: the sum's bit
    entry is held to what |S| honest bits and their noise reach (|S|·s/2 + 6 stddevs of the summed
    noise). A member whose entry claims ``forged_count`` devices' worth (instead of ±½) gets the
    group discarded, like every secure sum out of bound: nothing applied, C unchanged."""
    ids = [f"dev{i}" for i in range(KAPPA)]
    identities, agg, registry = in_memory_keys(ids)
    job = adaptive_job(ids, agg, registry)
    chosen = job.next_participants(set(ids))
    total, survivors, dp, vectors = run_group(job, identities, agg, chosen, [0.01] * KAPPA)
    forged = total.copy()                     # one member's entry (b − ½)·s + noise replaced by its forgery
    forged[-2] += forged_count * dp["clip_bit_scale"] - vectors[chosen[0]][-2]
    round_ = job.round
    job.group_summed(round_, forged, survivors)
    assert job.secure_failure(round_).startswith("group sum out of bound: the clipped-indicator entry")
    assert job.round_step() == (None, 0, 0) and job.dp.clip.value == CLIP
    # the honest sum of the same group is applied (the check does not refuse honest noise)
    job.group_summed(round_, total, survivors)
    assert job.round_step()[0] is not None and job.dp.clip.value != CLIP


def test_a_forged_update_entry_is_held_to_cs_bound_however_wide_the_bit_entry():
    """With σ_b just above z/2 the bit's scale s is large (s/2 ≈ 2.5 here, C = 0.5): the round's
    fixed-point range takes it, but an update entry is still held to what |S| clipped updates and
    their noise reach (max(C, 1) per member), not to s/2 — it was, and a member could move the
    model by the difference."""
    ids = [f"dev{i}" for i in range(KAPPA)]
    identities, agg, registry = in_memory_keys(ids)
    job = adaptive_job(ids, agg, registry, dp_count_stddev=0.51)
    chosen = job.next_participants(set(ids))
    total, survivors, dp, vectors = run_group(job, identities, agg, chosen, [0.01] * KAPPA)
    assert dp["clip_bit_scale"] / 2 > 2 * max(CLIP, 1.0)
    forged = total.copy()                     # one update entry past |S| members' reach, within |S|·s/2
    forged[0] = len(survivors) * (noisy_bound(max(CLIP, 1.0), dp["stddev"]) + 0.5)
    assert forged[0] < len(survivors) * noisy_bound(dp["clip_bit_scale"] / 2, dp["stddev"])
    round_ = job.round
    job.group_summed(round_, forged, survivors)
    assert job.secure_failure(round_).startswith("group sum out of bound: a DP group of")
    assert job.round_step() == (None, 0, 0) and job.dp.clip.value == CLIP
    job.group_summed(round_, total, survivors)          # the honest sum of the same group is applied
    assert job.round_step()[0] is not None


D, C, N = 6, 3, 30


def device_task(i):
    """Device i's head training on its own data: small features (update norm ~0.6, within C0) for
    even i, large ones (~1.8, beyond it) for odd i."""
    rng = np.random.default_rng(7 + i)
    y = rng.integers(0, C, N)
    Z = ((0.5 if i % 2 == 0 else 2.0) * (rng.normal(size=(N, D)) + 2 * np.eye(C, D)[y])).astype(np.float32)
    return HeadTrainingTask(Z, y, lambda b, s, w: Features(D))


class ClipNormsSeen:
    """A device's training that notes the C each of its tasks' ``dp`` carried (what went over the wire)."""

    def __init__(self, training, seen: list):
        self.training, self.seen = training, seen

    def __call__(self, params, tensors):
        self.seen.append(params["dp"]["clip_norm"])
        return self.training(params, tensors)


def test_secure_adaptive_clipping_over_mqtt_follows_the_plain_rule(broker, tmp_path):
    """A secure DP-FedAvg job with dp_adaptive_clip over mosquitto: its devices send their bits in
    the masked sum, and its C sequence and model equal a plain (central) adaptive DP-FedAvg job's,
    replayed over the devices in each sum, which computes each bit from the update itself. Both
    noises are negligible here (z = 1e-8, σ_b = 1e-8: the comparison is of the bits and the rule).
    The two runs' noises are independent and training carries them on: at z = 1e-6 the models
    differed by 1e-5 to 5e-5 (the test failed one run in two), at 1e-8 by at most 1.7e-6."""
    ids = [f"dev{i}" for i in range(6)]
    identities, agg, registry = in_memory_keys(ids)
    common = dict(job_id="sac", num_classes=C, feature_dim=D, rounds=4, clients_per_round=5, round_timeout_s=60,
                  local_epochs=2, batch_size=8, client_lr=0.05, expected_devices=6, seed=4,
                  dp_noise_multiplier=1e-8, dp_clip_norm=1.0, dp_adaptive_clip=True, dp_count_stddev=1e-8,
                  dp_target_quantile=0.5, dp_clip_lr=0.5)
    job = SecureFedAvgJob(SecureFedAvgConfig(**common, max_samples=100, max_abs_param=20.0, phase_timeout_s=120),
                          identity=agg, registry=registry)
    service = RecordingService(job, broker.url, tmp_path, set(ids), ServiceSettings(evaluate_every_contribution=False))
    tasks, seen = {d: device_task(i) for i, d in enumerate(ids)}, []
    agents = start_secure_fedavg_agents(broker.url, identities, agg.public_key_bytes, SECURE_FEDAVG_KIND,
                                        {d: ClipNormsSeen(task, seen) for d, task in tasks.items()})
    result = service.join(90)
    for a in agents:
        a.stop()
    assert result.get("state") == "done", result
    assert len(result["rounds"]) == 4 and not job.failed_rounds
    # the C of rounds 1-4 as the devices received it, then the C the last round's bits gave
    secure_c = list(dict.fromkeys(seen)) + [job.dp.clip.value]

    replay = FedAvgJob(FedAvgConfig(**common, **PLAIN_MEAN))      # central DP: the server clips and counts
    plain_c = [replay.dp.clip.value]
    for r in result["rounds"]:
        chosen = replay.next_participants(set(ids))               # the same seeded draw as the secure job's
        assert set(r["accepted"]) == set(chosen)
        replay_round(replay, sorted(r["accepted"]), tasks)
        plain_c.append(replay.dp.clip.value)
    assert len(set(np.round(plain_c, 6))) == 5                   # C moved every round
    np.testing.assert_allclose(secure_c, plain_c, rtol=1e-5)
    for k in ("weight", "bias"):
        np.testing.assert_allclose(job.params[k], replay.params[k], rtol=0, atol=1e-5)
