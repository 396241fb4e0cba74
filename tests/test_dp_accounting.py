"""Privacy accounting: the ε a DP job reports is dp-accounting's for the noise it actually adds,
and a job refuses to start, or stops before a round, when its budget would be exceeded."""

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from scipy import stats
from scipy.stats import norm

from aggregator.jobs.registry import build_job
from aggregator.compute.privacy import PrivacyAccountant, noise_multiplier_for
from protocols.rounds import RoundClosed


def library_epsilon(z, rounds, q, delta):
    """The library's own number, built here without aggregator.compute.privacy."""
    accountant = rdp.RdpAccountant()
    event = dp_accounting.GaussianDpEvent(z)
    accountant.compose(event if q == 1 else dp_accounting.PoissonSampledDpEvent(q, event), rounds)
    return accountant.get_epsilon(delta)


def gaussian_delta(epsilon, z):
    """Exact δ(ε) of one Gaussian mechanism with multiplier z (Balle & Wang 2018, Thm 8)."""
    return norm.cdf(0.5 / z - epsilon * z) - np.exp(epsilon) * norm.cdf(-0.5 / z - epsilon * z)


@pytest.mark.parametrize("z,rounds,q", [(1.0, 1, 1.0), (0.8, 10, 0.05), (2.0, 50, 0.2), (5.0, 10, 1.0)])
def test_accountant_is_the_library_and_sound(z, rounds, q):
    eps = PrivacyAccountant(z, 1e-5, q).epsilon(rounds)
    assert eps == pytest.approx(library_epsilon(z, rounds, q, 1e-5), rel=1e-12)
    # an independent bound: the near-exact PLD accountant never reports more than RDP does
    exact = pld.PLDAccountant(value_discretization_interval=1e-3)   # coarser: pessimistic, faster
    exact.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)) if q < 1
                  else dp_accounting.GaussianDpEvent(z), rounds)
    assert exact.get_epsilon(1e-5) <= eps * (1 + 1e-6)
    if rounds == 1 and q == 1.0:                         # and the closed form agrees it is sound
        assert gaussian_delta(eps, z) <= 1e-5


def test_noise_multiplier_for_is_the_smallest_within_the_budget():
    z = noise_multiplier_for(2.0, 1e-5, 20)
    assert library_epsilon(z, 20, 1.0, 1e-5) <= 2.0 < library_epsilon(z * 0.99, 20, 1.0, 1e-5)


def test_fedavg_job_noise_has_the_scale_its_reported_epsilon_assumes():
    """Rounds without updates release pure noise: N(0, (zC/κ)²) per entry, and the job's ε after
    those rounds is the library's for (z, rounds, q = κ / population)."""
    z, clip, kappa, population = 1.3, 0.7, 4, 40
    cfg = {"num_classes": 10, "feature_dim": 1000, "rounds": 3, "clients_per_round": kappa,
           "dp_noise_multiplier": z, "dp_clip_norm": clip, "dp_population": population}
    job = build_job("fedavg", cfg)
    job.dp.rng = np.random.default_rng(1)
    steps = []
    for _ in range(3):
        before = job.params["weight"].astype(np.float64)
        assert job.next_participants({f"d{i}" for i in range(population)})     # κ of the population
        job.close_round(RoundClosed(job.round, (), ("d0",), (), ()))
        steps.append(job.params["weight"].astype(np.float64) - before)
    noise = np.concatenate([s.ravel() for s in steps])
    sigma = z * clip / kappa
    dof = noise.size
    lo, hi = stats.chi2.ppf([1e-6, 1 - 1e-6], dof) / dof
    assert lo < np.mean(noise ** 2) / sigma ** 2 < hi
    report = job.evaluate(None, None)["privacy"]
    assert report["releases"] == 3 and report["sampling_rate"] == kappa / population
    assert report["epsilon"] == pytest.approx(library_epsilon(z, 3, kappa / population, 1e-5), rel=1e-12)


def test_job_refuses_to_start_when_one_round_exceeds_the_budget():
    with pytest.raises(ValueError, match="privacy budget"):
        build_job("fedavg", {"dp_noise_multiplier": 0.5, "dp_target_epsilon": 1.0})
    with pytest.raises(ValueError, match="privacy budget"):
        build_job("fed3r", {"dp_noise_multiplier": 0.5, "dp_target_epsilon": 1.0, "feature_clip_norm": 1.0})
    with pytest.raises(ValueError, match="feature_clip_norm"):
        build_job("fed3r", {"dp_noise_multiplier": 5.0})
    with pytest.raises(ValueError, match="dp_delta"):
        build_job("fedavg", {"dp_noise_multiplier": 1.0, "dp_delta": 0.5})


def test_job_stops_before_the_round_that_would_exceed_the_budget():
    z, q, target = 1.0, 0.1, 3.0
    job = build_job("fedavg", {"num_classes": 3, "feature_dim": 4, "rounds": 1000, "clients_per_round": 2,
                               "dp_noise_multiplier": z, "dp_population": 20, "dp_target_epsilon": target})
    online = {f"d{i}" for i in range(20)}
    while job.next_participants(online):
        job.close_round(RoundClosed(job.round, (), (), (), ()))
    rounds = job.round
    assert library_epsilon(z, rounds, q, 1e-5) <= target < library_epsilon(z, rounds + 1, q, 1e-5)
    assert job.finished(online, online) and rounds < 1000
    report = job.evaluate(None, None)["privacy"]
    assert report["budget_exhausted"] and report["epsilon"] <= target


def test_fed3r_is_one_release_whatever_the_rounds():
    job = build_job("fed3r", {"num_classes": 3, "feature_dim": 4, "dp_noise_multiplier": 2.0,
                              "feature_clip_norm": 1.0, "max_samples": 5, "dp_mechanism": "gaussian"})   # RDP-accounted
    assert job.evaluate(None, None)["privacy"]["epsilon"] == 0.0
    job.strategy.released.n_contributions = 7            # as after several released rounds
    assert job.evaluate(None, None)["privacy"]["epsilon"] == pytest.approx(library_epsilon(2.0, 1, 1.0, 1e-5))


def test_a_sampled_dp_jobs_participants_cannot_be_redrawn_from_its_config():
    """A review's finding: the accountant counted on sampling (q = κ / dp_population) while the
    draw was seeded by the config, so anyone holding it knew who was in each round (each such round
    a plain release of them). With q < 1 the draw is a secret of the job's own; without sampling
    the config's seed still fixes it (reproducible runs)."""
    pool = {f"d{i:02d}" for i in range(20)}
    base = {"num_classes": 3, "feature_dim": 8, "clients_per_round": 2, "dp_noise_multiplier": 1.0,
            "dp_clip_norm": 1.0}
    sampled = [tuple(build_job("fedavg", {**base, "dp_population": 20}).next_participants(pool)) for _ in range(5)]
    assert len(set(sampled)) > 1                                   # five equal draws: (1/190)^4
    assert len({tuple(build_job("fedavg", base).next_participants(pool)) for _ in range(3)}) == 1


def test_a_sampled_dp_jobs_draw_is_keyed_aes_and_resumes_from_its_bookkeeping():
    """Under sampled DP the draw is AES-128-CTR under the job's secret key (a Mersenne Twister's
    state follows from enough of its outputs, and every device sees part of each draw): its bits
    are the key's AES blocks of the counter 0, 1, ... (checked with AES itself, block by block),
    its saved state resumes the same draws in a job built anew (whose own key differs), a job
    without sampling keeps its seeded Mersenne Twister, and a Twister's saved state, as every
    checkpoint before keyed draws holds, still resumes one."""
    import json
    import random

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from aggregator.jobs.participant_draw import KeyedDraw, draw_state, restored_draw

    key = 0x0123456789ABCDEF0011223344556677
    aes = Cipher(algorithms.AES(key.to_bytes(16, "big")), modes.ECB()).encryptor()
    blocks = [int.from_bytes(aes.update(i.to_bytes(16, "big")), "big") for i in range(4)]
    draw = KeyedDraw(key)
    assert draw.getrandbits(128) == blocks[0] and draw.getrandbits(20) == blocks[1] >> 108
    assert draw.getrandbits(200) == ((blocks[2] << 128) | blocks[3]) >> 56

    pool = {f"d{i:03d}" for i in range(200)}
    config = {"num_classes": 3, "feature_dim": 8, "clients_per_round": 5, "rounds": 100, "dp_noise_multiplier": 1.0,
              "dp_clip_norm": 1.0, "dp_population": 400}
    job = build_job("fedavg", config)
    assert isinstance(job._rng, KeyedDraw)
    for _ in range(3):
        job.close_round(RoundClosed(job.round, (), tuple(job.next_participants(pool)), (), ()))
    saved = json.loads(json.dumps(job.bookkeeping()))
    ahead = []
    for _ in range(4):
        ahead.append(job.next_participants(pool))
        job.close_round(RoundClosed(job.round, (), tuple(ahead[-1]), (), ()))
    resumed = build_job("fedavg", config)
    resumed.restore_bookkeeping(saved)
    again = []
    for _ in range(4):
        again.append(resumed.next_participants(pool))
        resumed.close_round(RoundClosed(resumed.round, (), tuple(again[-1]), (), ()))
    assert again == ahead and any(ahead)

    plain = build_job("fedavg", {k: v for k, v in config.items() if k != "dp_population"})
    assert type(plain._rng) is random.Random
    twister = random.Random(5)
    old = restored_draw(json.loads(json.dumps(draw_state(twister))))
    assert type(old) is random.Random and [old.random() for _ in range(3)] == [twister.random() for _ in range(3)]
    with pytest.raises(ValueError, match="keyed draw"):
        restored_draw([KeyedDraw.VERSION, [1, 2, 3], None])


def check_rounds_sample_at_most_the_accounted_rate(make_job, kappa, population, rounds=400):
    """Each round draws q·|pool| of the pool in expectation (q = κ / population; its integer part,
    or one more), at most κ, so over many rounds no device is drawn more often than a binomial
    tail of q allows; a pool too small for one device per round opens none (a draw of nobody
    redrawn at the next tick would put each device in every opened round with 1/|pool|, not q).
    ``make_job()`` builds a fresh DP job with this κ and dp_population."""
    q = kappa / population
    for online in (10, population // 10 - 1, population // 4, population, 5 * population):
        pool = {f"d{i:04d}" for i in range(online)}
        job, seen, sizes = make_job(), dict.fromkeys(pool, 0), []
        while len(sizes) < rounds:
            chosen = job.next_participants(pool)
            sizes.append(len(chosen))
            for d in chosen:
                seen[d] += 1
            if chosen:
                job.close_round(RoundClosed(job.round, (), tuple(chosen), (), ()))
        expected = min(kappa, q * online)
        if expected < 1:
            assert set(sizes) == {0}, online
            assert f"q·pool = {kappa * online}/{population} < 1" in job.waiting and f"{online} eligible" in job.waiting
            continue
        assert job.waiting is None
        assert set(sizes) <= {min(kappa, int(q * online)), min(kappa, int(q * online) + 1)}, online
        if expected < kappa:             # the size's mean is q·|pool| (within a binomial tail of it)
            lo, hi = stats.binom.interval(1 - 1e-9, rounds, expected - int(expected))
            assert lo <= sum(sizes) - rounds * int(expected) <= hi, (online, sum(sizes))
        # each round draws its devices uniformly: a device's chance is <= q
        assert max(seen.values()) <= stats.binom.ppf(1 - 1e-9 / online, rounds, q)


def test_no_online_device_is_sampled_more_often_than_the_rate_epsilon_counts():
    """A review's finding: ε counted q = κ / dp_population while the scheduler drew κ of whoever
    was online, so 10 devices online of a declared 1,000 were each in every round (after 100
    rounds at z = 1: ε 1.2 reported, 96 spent). A round now draws q·|pool| devices in expectation."""
    cfg = {"num_classes": 3, "feature_dim": 8, "clients_per_round": 10, "rounds": 10 ** 6,
           "dp_noise_multiplier": 1.0, "dp_clip_norm": 1.0, "dp_population": 1000}
    check_rounds_sample_at_most_the_accounted_rate(lambda: build_job("fedavg", cfg), 10, 1000)
    # without sampling claimed (no population): κ of the pool, however small it is
    job = build_job("fedavg", {**cfg, "dp_population": 0})
    assert len(job.next_participants({f"d{i}" for i in range(5)})) == 5


def test_the_service_status_says_why_a_dp_job_opens_no_round(tmp_path):
    """A DP job whose pool is too small to sample one device a round waited without a word: the
    live status (admin API, ``fedfleet admin status``, dashboard) now carries the job's reason."""
    from aggregator.security.fleet import Fleet
    from aggregator.service.active_job import ActiveJob
    from aggregator.service.reporting import live_snapshot, status_summary
    from aggregator.storage.schema import JobState
    from fedfleet.admin_rendering import progress_line

    cfg = {"num_classes": 3, "feature_dim": 8, "clients_per_round": 10, "rounds": 5,
           "dp_noise_multiplier": 1.0, "dp_clip_norm": 1.0, "dp_population": 1000, "job_id": "small"}
    a = ActiveJob(build_job("fedavg", cfg), "fedavg", tmp_path)
    fleet = Fleet(None, None, None, False)
    assert a.job.next_participants({f"d{i}" for i in range(40)}) == []
    status = live_snapshot(a, fleet, {})
    assert "q·pool = 400/1000 < 1" in status["job"]["waiting"] and "it opens with 100 online" in status["job"]["waiting"]
    assert status["job"]["waiting"] in progress_line(status_summary(status))     # as /api/status answers it
    a.state = JobState.PAUSED                               # a paused job waits for its operator, not for devices
    assert live_snapshot(a, fleet, {})["job"]["waiting"] is None
    a.state = JobState.RUNNING
    assert len(a.job.next_participants({f"d{i}" for i in range(100)})) == 1
    assert live_snapshot(a, fleet, {})["job"]["waiting"] is None
    # one short of a device per round: 999 of 1,000 (a rounded 0.999 read "1.00 < 1")
    edge = build_job("fedavg", {**cfg, "clients_per_round": 1})
    assert edge.next_participants({f"d{i}" for i in range(999)}) == [] and "q·pool = 999/1000 < 1" in edge.waiting
    # a secure job's round needs three members with keys: two online say so, none online says nothing
    from aggregator.jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob
    from ops_fleet import in_memory_keys

    _, agg, registry = in_memory_keys(["d0", "d1", "d2"])
    secure = SecureFedAvgJob(SecureFedAvgConfig(**{k: v for k, v in cfg.items() if not k.startswith("dp_")},
                                                max_samples=100, max_abs_param=1e4), identity=agg, registry=registry)
    assert secure.next_participants({"d0", "d1", "stranger"}) == []
    assert secure.waiting == "waiting for devices: a secure round needs 3 with keys online, 2 are"
    assert secure.next_participants(set()) == [] and secure.waiting is None
    secure.round = secure.config.rounds                     # done: nothing to wait for
    assert secure.next_participants({"d0", "d1"}) == [] and secure.waiting is None


def test_members_of_an_unmasked_but_discarded_group_are_not_released_twice_unaccounted():
    """A review's finding (Fed3R-Sync, distributed DP): a group whose noisy sum was unmasked and then
    discarded (its count slot says a member ignored block_scales) left its members eligible, and the
    job reported ε = 0 after that release; a later group released them again."""
    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
    from protocols.identity import DeviceIdentity, IdentityRegistry

    D, C = 6, 3
    devices = [f"cam-{i}" for i in range(9)]
    cfg = Fed3RSyncConfig(num_classes=C, feature_dim=D, dp_noise_multiplier=2.0, feature_clip_norm=5.0,
                          max_samples=1, clients_per_round=3, seed=4, max_abs_feature=50.0)
    job = Fed3RSyncJob(cfg, identity=DeviceIdentity.generate("aggregator"),
                       registry=IdentityRegistry({d: DeviceIdentity.generate(d).public_key_bytes for d in devices}))
    first = job.next_participants(set(devices))
    assert len(first) == 3
    # the protocol unmasked the group's (noisy) sum: the server now holds it ...
    unmasked = np.zeros(job.vector_length)
    unmasked[:-1] = np.random.default_rng(0).normal(size=job.vector_length - 1)
    unmasked[-1] = 2.0                      # ... but one member's library ignored block_scales (0 in its slot)
    job.group_summed(job.round, unmasked, tuple(first))
    assert job.failed_rounds, "the group is discarded as out of bound"

    again = set(first) & set(job.eligible(set(devices)))
    report = job.evaluate(None, None)["privacy"]
    one = PrivacyAccountant(cfg.dp_noise_multiplier, cfg.dp_delta, 1.0, report["accounting"]).epsilon(1)
    assert not again, f"{sorted(again)} were in an unmasked (released) sum and can be asked again"
    assert report["releases"] == 1 and report["epsilon"] == pytest.approx(one), report


def test_members_of_a_secure_round_lost_to_a_restart_are_never_asked_again():
    """A review's finding (Fed3R-Sync, distributed DP): a group's noisy sum unmasked, then the process
    killed before the round's close committed (its members' release marks lost with it); the restart
    restored the previous checkpoint and a later group unmasked a second noisy sum of the same
    devices, the job still reporting one release. A restored round's members now count as released."""
    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
    from protocols.identity import DeviceIdentity, IdentityRegistry
    from protocols.rounds import RoundClosed

    D, C = 6, 3
    devices = [f"cam-{i}" for i in range(6)]
    identity = DeviceIdentity.generate("aggregator")
    registry = IdentityRegistry({d: DeviceIdentity.generate(d).public_key_bytes for d in devices})
    cfg = Fed3RSyncConfig(num_classes=C, feature_dim=D, dp_noise_multiplier=2.0, feature_clip_norm=5.0,
                          max_samples=1, clients_per_round=3, seed=4, max_abs_feature=50.0, dp_mechanism="gaussian")
    job = Fed3RSyncJob(cfg, identity=identity, registry=registry)
    checkpoint = (job.state_dict(), dict(job.contributed))          # the store's, before round 1 closes
    first = job.next_participants(set(devices))
    opened = job.bookkeeping()                                       # stored when round 1 opened
    job.group_summed(job.round, np.random.default_rng(0).normal(size=job.vector_length), tuple(first))
    assert set(first) <= set(job.contributed)                        # released: live, never asked again
    # killed here; the restart: the checkpoint, the open round's bookkeeping, the round closed dead
    restarted = Fed3RSyncJob(cfg, identity=identity, registry=registry)
    restarted.load_state_dict(checkpoint[0])
    restarted.contributed = dict(checkpoint[1])
    restarted.restore_bookkeeping(opened)
    assert not restarted.secure_round_live(1)
    restarted.close_round(RoundClosed(1, (), tuple(first), (), ()))
    assert not set(first) & set(restarted.eligible(set(devices)))
    later = restarted.next_participants(set(devices))
    assert later and not set(first) & set(later)
    # a round this process ran and gave up (its deadline) releases nothing: its members stay eligible
    live = Fed3RSyncJob(cfg, identity=identity, registry=registry)
    chosen = live.next_participants(set(devices))
    live.close_round(RoundClosed(live.round, (), tuple(chosen), (), ()))
    assert set(chosen) <= set(live.eligible(set(devices)))
