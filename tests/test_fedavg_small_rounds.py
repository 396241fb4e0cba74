"""FedAvg(ψ) rounds of fewer than three updates: a device alone in a round (or with one other) is
bounded by the reference of earlier rounds, or moves nothing before there is one, against a numpy
pipeline of the small-round rule as docs/algorithms.md states it; rounds of three or more are bit
for bit what they were; the reference and its pool survive a checkpoint; it is off where no layer
acts."""

import numpy as np
import pytest

from aggregator.jobs.fedavg import FedAvgConfig
from aggregator.jobs.registry import build_job
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.strategies.robust_fedavg import NormBound, WeightBound
from protocols.rounds import RoundClosed

from robust_fedavg_reference import NORM_BOUND_ONLY, as_matrix, split


EVIL_SHIFT, EVIL_CLAIM = 1e5, 10 ** 9          # within the wire's 2^20, and a claimed count of 10^9


def lower_median(values):
    values = np.sort(np.asarray(values, dtype=np.float64))
    return values[(len(values) - 1) // 2]


def small_round_pipeline_reference(x0, rounds, beta=0.7, norm=1.0, weight=2.0, contribution=0.5, screen=True):
    """FedAvg(ψ)'s defaults in numpy with the small-round rule as docs/algorithms.md states it, the
    heads after each round. ``rounds``: per round, device -> (vector as ``as_matrix`` orders it, n).

    Per round of m updates: the norm limit (norm × lower median ‖Δ‖), the weight cap (weight ×
    lower median n), the pull limit (contribution × lower median w·‖Δ‖ after both), each, in a round
    of m < 3 with a reference all of whose limits are > 0, the smaller positive one of its own and
    the reference's; with m = 1 and no such reference nothing moves. A round of m >= 3 makes its
    limits the reference; a smaller one adds each device's (‖Δ‖, n, pull) to a pool (a device's
    latest), whose limits become the reference once it holds 3 devices. Then the screen (m >= 3),
    the weighted mean of what is kept and the history's momentum."""
    x, s, reference, pool, heads = x0.astype(np.float64), None, None, {}, []
    for updates in rounds:
        devices = sorted(updates)
        m = len(devices)
        usable = reference is not None and min(reference) > 0
        small = m < 3

        def limit(i, own):
            return (min(own, reference[i]) if own > 0 else reference[i]) if small and usable else own

        d = np.stack([updates[k][0] for k in devices]) - x
        n = np.array([updates[k][1] for k in devices], dtype=np.float64)
        norms = np.linalg.norm(d, axis=1)
        norm_limit = limit(0, norm * lower_median(norms))
        if norm_limit:
            d = d * np.minimum(1.0, norm_limit / norms)[:, None]
        weight_limit = limit(1, weight * lower_median(n))
        w = np.minimum(n, weight_limit)
        pulls = w * np.linalg.norm(d, axis=1)
        pull_limit = limit(2, contribution * lower_median(pulls))
        if pull_limit:
            w = np.where(pulls > pull_limit, w * pull_limit / pulls, w)
        held = small and m == 1 and not usable
        if not small:
            reference, pool = (norm_limit, weight_limit, pull_limit), {}
        else:
            pool.update({k: (norms[i], n[i], pulls[i]) for i, k in enumerate(devices)})
            if len(pool) >= 3:
                rows = np.array([pool[k] for k in sorted(pool)])
                pooled = (norm * lower_median(rows[:, 0]), weight * lower_median(rows[:, 1]),
                          contribution * lower_median(rows[:, 2]))
                reference = tuple(np.minimum(reference, pooled)) if usable else pooled
                pool = {}
        if not held:
            keep = d @ np.median(d, axis=0) > 0 if screen and m >= 3 else np.ones(m, dtype=bool)
            keep = keep if keep.any() else np.ones(m, dtype=bool)
            a = (w[keep, None] * d[keep]).sum(0) / w[keep].sum()
            s = a if s is None else beta * s + (1 - beta) * a
            x = (x + s).astype(np.float32)
        heads.append(np.array(x, dtype=np.float64))
    return heads


def head_vector(job):
    return as_matrix([({"weight": job.params["weight"], "bias": job.params["bias"]}, 1)])[0]


def play(job, rounds):
    """Close ``rounds`` (device -> (vector, n)) on ``job``; its head after each. An entry None is the
    attacker, whose vector is computed at the head it is given: every entry moved by EVIL_SHIFT."""
    heads = []
    for updates in rounds:
        job.next_participants(set(updates))
        x = head_vector(job)
        job._updates = {k: (split(x + EVIL_SHIFT if v is None else v[0]), EVIL_CLAIM if v is None else v[1])
                        for k, v in updates.items()}
        job.close_round(RoundClosed(job.round, tuple(sorted(updates)), (), (), ()))
        heads.append(head_vector(job))
    return heads


def honest_round(devices, seed):
    rng = np.random.default_rng(seed)
    return {d: (rng.normal(0.0, 0.1, size=8), int(rng.integers(10, 60))) for d in devices}


def resolved(rounds, heads_before):
    """``rounds`` with the attacker's vector as it sends it (at the head it was given)."""
    return [{k: ((x + EVIL_SHIFT, EVIL_CLAIM) if v is None else v) for k, v in updates.items()}
            for updates, x in zip(rounds, heads_before)]


FLEET = [f"h{i}" for i in range(5)]
SMALL_ROUND_SCENARIOS = {
    # the review's: the attacker is the only device online for the job's first round
    "alone first": [{"evil": None}] + [honest_round(FLEET, 20 + r) for r in range(3)],
    # alone in a later round, then with one honest device, honest rounds between
    "alone later": [honest_round(FLEET, 30), {"evil": None}, honest_round(FLEET, 31),
                    {"evil": None, **honest_round(["h0"], 32)}, honest_round(FLEET, 33)],
    # a review's finding: two attackers alone in a round each, then one honest device, made a pool of
    # three whose lower median was theirs, and the next lone round took it (pooled limits only tighten)
    "two alone, then one": [honest_round(FLEET, 50), {"evil": None}, {"evil2": None}, honest_round(["h1"], 51),
                            {"evil": None}, honest_round(FLEET, 52)],
}


def played_as_the_reference_says(job, rounds, screen: bool) -> list[np.ndarray]:
    """The job's heads over ``rounds``, each checked against the numpy pipeline's."""
    heads = play(job, rounds)
    want = small_round_pipeline_reference(np.zeros(8), resolved(rounds, [np.zeros(8)] + heads[:-1]), screen=screen)
    for got, expected in zip(heads, want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    return heads


@pytest.mark.parametrize("screen", [True, False], ids=["whole round", "canonical sums"])
@pytest.mark.parametrize("scenario", sorted(SMALL_ROUND_SCENARIOS))
def test_a_device_alone_in_a_round_is_bounded_by_the_reference_of_earlier_rounds(scenario, screen):
    """A review's finding: every bound is relative to the round's own median, which in a round of
    one update is that update's: a device alone in a round, its head moved by 10^5 with n = 10^9,
    moved the model by 10^5 and the history carried it on. Now such a round is bounded by the last
    full round's limits, and moves nothing before there are any (against numpy; the job's
    canonical-sums path with the screen off, the whole-round path with it on)."""
    rounds = SMALL_ROUND_SCENARIOS[scenario]
    job = build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 5, "init": "zeros",
                               "rounds": len(rounds), "direction_screen": screen})
    heads = played_as_the_reference_says(job, rounds, screen)
    honest_norms = [np.linalg.norm(v - x) for updates, x in zip(rounds, [np.zeros(8)] + heads[:-1])
                    for v, _ in (u for u in updates.values() if u is not None)]
    steps = np.linalg.norm(np.diff(np.stack([np.zeros(8)] + heads), axis=0), axis=1)
    assert steps.max() <= max(honest_norms)          # no round moved further than an honest update (10^5 before)
    if scenario == "alone first":
        assert steps[0] == 0                         # no reference yet: a round of one moves nothing


def test_a_job_of_one_device_a_round_moves_once_three_devices_have_answered():
    """κ = 1: a round of one update moves nothing until three distinct devices have answered (h0
    twice counts once); their statistics' lower medians are the reference then, and bound the
    attacker's round as any other (against numpy)."""
    rounds = [honest_round(["h0"], 40), honest_round(["h0"], 41), honest_round(["h1"], 42),
              honest_round(["h2"], 43), {"evil": None}, honest_round(["h1"], 44), honest_round(["h3"], 45)]
    job = build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 1, "init": "zeros",
                               "rounds": len(rounds), "direction_screen": False})
    heads = played_as_the_reference_says(job, rounds, screen=False)
    assert all(not h.any() for h in heads[:4]) and heads[4].any()
    assert np.abs(heads[4]).max() < 1.0              # the attacker's round: an honest-sized step


def test_rounds_of_three_or_more_updates_are_bit_for_bit_what_they_were():
    """The reference only bounds rounds of fewer than three updates: over rounds of 3, 5 and 7
    updates (an outlier among them) the heads are the same bits with it on and off, on both of the
    job's paths; with PLAIN_MEAN's layers off it has nothing to bound."""
    from aggregator.strategies.small_round_reference import SmallRoundReference

    rounds = [honest_round(FLEET[:3], 50), {**honest_round(FLEET, 51), "h4": (np.full(8, 30.0), 900)},
              honest_round([f"d{i}" for i in range(7)], 52), honest_round(FLEET[1:4], 53)]
    for base in ({}, {"direction_screen": False}, {"aggregator": "median"}, PLAIN_MEAN, NORM_BOUND_ONLY):
        config = {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, "init": "zeros", "rounds": 4, **base}
        on = build_job("fedavg", {**config, "small_round_reference": True})
        off = build_job("fedavg", {**config, "small_round_reference": False})
        for got, want in zip(play(on, rounds), play(off, rounds)):
            assert got.tobytes() == want.tobytes(), base
        assert on.state_dict().keys() - off.state_dict().keys() <= {SmallRoundReference.LIMITS}


def test_the_reference_and_its_pool_survive_a_checkpoint():
    """Resumed from a checkpoint that holds the reference (or a pool of small rounds' statistics),
    a job bounds a later lone device's round as the uninterrupted one does, bit for bit; without
    them it holds that round instead."""
    from aggregator.strategies.small_round_reference import SmallRoundReference

    cases = {"reference": (1, [honest_round(FLEET, 60), {"evil": None}]),
             "pool": (2, [honest_round(["h0"], 62), honest_round(["h1"], 63),
                          {"evil": None, **honest_round(["h2"], 64)}, {"evil": None}])}
    for name, (at, rounds) in cases.items():
        config = {"num_classes": 2, "feature_dim": 3, "clients_per_round": 5, "init": "zeros",
                  "rounds": len(rounds), "direction_screen": False}
        whole, first = build_job("fedavg", config), build_job("fedavg", config)
        play(whole, rounds)
        play(first, rounds[:at])
        state = first.state_dict()
        assert (SmallRoundReference.LIMITS in state) == (name == "reference")
        assert (SmallRoundReference.POOL in state) == (name == "pool")
        resumed, forgetful = build_job("fedavg", config), build_job("fedavg", config)
        resumed.load_state_dict(state)
        forgetful.load_state_dict({k: v for k, v in state.items() if "bounds." not in k})
        resumed_heads, forgetful_heads = play(resumed, rounds[at:]), play(forgetful, rounds[at:])
        assert resumed.params["weight"].tobytes() == whole.params["weight"].tobytes(), name
        # the last round, the attacker's alone: bounded, or held without what the checkpoint held
        resumed_heads.insert(0, head_vector(first))
        forgetful_heads.insert(0, head_vector(first))
        assert (resumed_heads[-1] != resumed_heads[-2]).any(), name
        assert (forgetful_heads[-1] == forgetful_heads[-2]).all(), name


def test_the_small_round_reference_is_the_lower_median_of_three_devices_and_ignores_order():
    from aggregator.strategies.small_round_reference import SmallRoundReference

    layers = [NormBound(1.0), WeightBound(2.0)]
    reference = SmallRoundReference(True, layers)
    assert reference.holds(1) and not reference.holds(2) and not reference.small(3)
    reference.observe(1, (0.0, 0.0), {"a": (5.0, 10.0)})
    reference.observe(1, (0.0, 0.0), {"a": (1.0, 90.0)})            # a's latest counts, once
    reference.observe(1, (0.0, 0.0), {"b": (3.0, 20.0)})
    assert reference.limits is None and sorted(reference.pool) == ["a", "b"]
    other = SmallRoundReference(True, layers)
    other.load_state_dict(reference.state_dict())
    for r in (reference, other):
        r.observe(2, (0.0, 0.0), {"d": (8.0, 30.0), "c": (2.0, 40.0)})
    # sorted norms 1, 2, 3, 8 and counts 20, 30, 40, 90: the lower middle values 2 and 30
    assert reference.limits.tolist() == other.limits.tolist() == [2.0, 60.0] and not reference.pool
    assert reference.limit(0, 7.0, 1) == 2.0 and reference.limit(0, 1.5, 2) == 1.5 and reference.limit(0, 0.0, 2) == 2.0
    assert reference.limit(0, 7.0, 3) == 7.0                        # a round of three: its own
    reference.observe(4, (0.0, 5.0, 9.0), None)                     # a full round whose devices did not move
    assert reference.holds(1) and reference.limit(0, 7.0, 1) == 7.0
    assert not SmallRoundReference(False, layers).holds(1) and not SmallRoundReference(True, []).holds(1)


def test_the_small_round_reference_is_off_where_no_layer_acts():
    """Off under DP (its clipped, noised mean uses no bound layer) and with every layer off (LADD's:
    tests/test_ladd_small_rounds.py)."""
    assert FedAvgConfig().small_rounds().enabled
    assert not FedAvgConfig(dp_noise_multiplier=1.0).small_rounds().enabled
    assert not FedAvgConfig(**{**PLAIN_MEAN, "small_round_reference": True}).small_rounds().enabled
