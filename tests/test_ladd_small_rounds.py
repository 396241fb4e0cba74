"""LADD's rounds of fewer than three updates (aggregator/strategies/ladd_small_rounds.py): φ's limits
are multiples of the round's median statistic and θ_c's of its cluster's (or of every cluster's θ
updates), so in a round of one update each limit was that update's own: one device alone in a
training round, sending every trained entry at 9·10^3 (within the parser's 10^4) with n = 10^7,
set φ and its cluster's θ_c to its own. Such a round is now bounded by the reference of earlier
rounds, φ's and the θ slots', as the FedAvg family's (``SmallRoundReference``).

Against an independent numpy computation of the rule as docs/algorithms.md states it (LADD's
layers: the norm bound at 3x and the weight bound at 2x the lower median), round by round over
real ``ladd.train`` envelopes, on one aggregator's canonical sums, on its whole-round path, and on
K shards (the same bytes, a coordinator restarted in the lone round keeping the reference from
its checkpoint)."""

import numpy as np
import pytest

from aggregator.jobs.registry import build_job
from aggregator.shards.buckets import shard_of
from aggregator.shards.coordinator_ladd import ShardedLaddJob
from aggregator.shards.shard import Receipt, ShardIngest
from aggregator.storage.store import Store
from protocols.envelope import decode
from protocols.payloads.ladd import KIND_STYLE, KIND_TRAIN, encode_style, encode_update
from protocols.rounds import RoundClosed

from test_ladd_aggregation import STYLE_CENTRES, TRUE_CLUSTER
from test_shard_fedavg import InProcessShards
from test_shard_ladd import DEVICES, JOB, assert_same_job, config_of, feed, message, restarted

NORM, WEIGHT = 3.0, 2.0         # LADD's defaults: the norm bound and the weight bound (no contribution bound)
EVIL, EVIL_ENTRY, EVIL_CLAIM = "d1", 9e3, 10 ** 7      # within the parser's |entry| <= 10^4 and n <= 10^7
FULL = list(DEVICES)            # three style clusters of three
SCENARIOS = {
    # the attacker is the only device to answer the job's first training round, and a later one
    "alone first": [[EVIL], FULL, [EVIL], FULL],
    # alone after a full round, then beside one honest device of another cluster
    "alone later": [FULL, [EVIL], [EVIL, "d2"], FULL],
    # rounds of one honest device each: three distinct devices make the reference that bounds the attacker
    "pooled": [["d0"], ["d3"], ["d5"], [EVIL], FULL],
    # the first round: the attacker beside one honest device of another cluster, no reference yet:
    # φ and both θ slots are bounded by the smaller device's statistics (every θ update of the round)
    "two first": [[EVIL, "d2"], FULL, [EVIL]],
}


def lower_median(values) -> float:
    values = np.sort(np.asarray(values, dtype=np.float64))
    return float(values[(len(values) - 1) // 2])


class NumpyReference:
    """The small-round rule for one kind of slot (φ, or every cluster's θ together), as stated in
    docs/algorithms.md: limits (norm, weight) of the latest round of >= 3 updates, or the lower
    medians of >= 3 distinct devices' statistics from smaller rounds (only tightening a usable one)."""

    def __init__(self):
        self.limits, self.pool = None, {}

    def usable(self) -> bool:
        return self.limits is not None and min(self.limits) > 0

    def limit(self, i: int, own: float, m: int) -> float:
        if m < 3 and self.usable():
            return min(own, self.limits[i]) if own > 0 else self.limits[i]
        return own

    def close(self, m: int, statistics: dict[str, tuple[float, float]]) -> None:
        rows = np.array([statistics[d] for d in sorted(statistics)])
        if m >= 3:
            self.limits, self.pool = (NORM * lower_median(rows[:, 0]), WEIGHT * lower_median(rows[:, 1])), {}
            return
        self.pool.update(statistics)
        if len(self.pool) >= 3:
            pooled = np.array([self.pool[d] for d in sorted(self.pool)])
            pooled = (NORM * lower_median(pooled[:, 0]), WEIGHT * lower_median(pooled[:, 1]))
            self.limits = tuple(np.minimum(self.limits, pooled)) if self.usable() else pooled
            self.pool = {}


def numpy_round(references, start, updates):
    """(φ, {c: θ_c}) after one round from ``start`` (the same, flattened over sorted tensor names) and
    ``updates`` (device -> (cluster, φ_k, θ_k, n_k)): each slot's updates norm-bounded at 3x, their
    weights at 2x the lower median of its own updates (a cluster of fewer than three: of every θ
    update of the round), both within the reference's in a round of fewer than three; a round of one
    without a usable reference moves nothing."""
    phi, theta = start
    devices = sorted(updates)
    m = len(devices)
    n = {d: float(updates[d][3]) for d in devices}
    new_phi, new_theta = phi.copy(), {c: v.copy() for c, v in theta.items()}
    for kind, reference in zip(("phi", "theta"), references):
        deltas = {d: (updates[d][1] - phi) if kind == "phi" else (updates[d][2] - theta[updates[d][0]])
                  for d in devices}
        norms = {d: float(np.linalg.norm(deltas[d])) for d in devices}
        groups = {"phi": devices} if kind == "phi" else {c: [d for d in devices if updates[d][0] == c]
                                                          for c in sorted({updates[d][0] for d in devices})}
        held = m == 1 and not reference.usable()
        for group, members in groups.items():
            pool = members if len(members) >= 3 else devices
            norm_limit = reference.limit(0, NORM * lower_median([norms[d] for d in pool]), m)
            weight_limit = reference.limit(1, WEIGHT * lower_median([n[d] for d in pool]), m)
            bounded = [deltas[d] * (min(1.0, norm_limit / norms[d]) if norm_limit and norms[d] else 1.0)
                       for d in members]
            w = np.array([min(n[d], weight_limit) for d in members])
            if not held:
                step = (w[:, None] * np.stack(bounded)).sum(axis=0) / w.sum()
                if kind == "phi":
                    new_phi = (phi + step).astype(np.float32).astype(np.float64)
                else:
                    new_theta[group] = (theta[group] + step).astype(np.float32).astype(np.float64)
        reference.close(m, {d: (norms[d], n[d]) for d in devices})
    return new_phi, new_theta


def style_of(device: str) -> np.ndarray:
    """test_ladd_aggregation's styles (three clusters of three), with noise of the device's own: the same
    clustering, cluster ids included, in every job a test builds."""
    style = np.full((3, 3, 3), 10.0, np.float32)
    style[:, 1, 1] = STYLE_CENTRES[TRUE_CLUSTER[device]] + np.random.default_rng(int(device[1:])).normal(0, 50, 3)
    return style


def flat(tensors, names) -> np.ndarray:
    return np.concatenate([np.asarray(tensors[k], dtype=np.float64).ravel() for k in sorted(names)])


def model_of(job):
    """(φ's trained tensors, {c: θ_c's}) flattened over sorted names."""
    phi_names = [k for k in job.trainable if not job.is_theta(k)]
    theta_names = [k for k in job.trainable if job.is_theta(k)]
    return flat(job.phi, phi_names), {c: flat(p, theta_names) for c, p in job.theta.items()}


def update_of(job, device, rng) -> tuple[dict, int]:
    """An honest device's update (its cluster model moved by noise) or the attacker's, at the model it was given."""
    model = job.cluster_model(job.assignment[device])
    if device == EVIL:
        return {k: np.full(model[k].shape, EVIL_ENTRY, np.float32) for k in job.trainable}, EVIL_CLAIM
    return ({k: (model[k] + rng.normal(scale=0.1, size=model[k].shape)).astype(np.float32) for k in job.trainable},
            int(rng.integers(5, 60)))


def play(tmp_path, rounds, shards_count: int = 0, restart_round: int = 0, total_rounds: int = 0, **over):
    """Close ``rounds`` (each: the devices that answer it; of a job of ``total_rounds``, by default
    as many) on one aggregator's job, and on a
    coordinator of ``shards_count`` shards given the same envelopes (restarted from its last
    checkpoint, as a restart rebuilds it, halfway through training round ``restart_round``);
    (one aggregator's job, the coordinator's job or None, [(start, updates)] per training round)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = config_of(tmp_path, **{"rounds": total_rounds or len(rounds), **over})
    single = build_job("ladd", config)
    shards = [ShardIngest(k, shards_count, Store(tmp_path / f"s{k}.db")) for k in range(shards_count)]
    for s in shards:
        s.set_job(JOB, "ladd", config)
    coordinator = ShardedLaddJob(build_job("ladd", config), "ladd", InProcessShards(shards)) if shards else None
    styles = {d: style_of(d) for d in DEVICES}
    for job in (single, coordinator) if coordinator else (single,):
        job.next_participants(set(DEVICES))
        for d in DEVICES:
            job.apply(d, job.parse_result(decode(message(d, job.round, KIND_STYLE, *encode_style(styles[d], 4, 1)))))
        job.close_round(RoundClosed(job.round, tuple(DEVICES), (), (), ()))
    assert single.assignment == {d: single.assignment[f"d{TRUE_CLUSTER[d]}"] for d in DEVICES}
    rng, played, checkpoint = np.random.default_rng(11), [], None
    for t, answering in enumerate(rounds, start=1):
        chosen = single.next_participants(set(answering))
        assert chosen == sorted(answering) and single.train_round == t
        bookkeeping, applied = None, []
        if coordinator:
            assert coordinator.next_participants(set(answering)) == chosen
            bookkeeping = coordinator.bookkeeping()
        start, updates = model_of(single), {}
        for device in chosen:
            arrays, n = update_of(single, device, rng)
            cluster = single.assignment[device]
            raw = message(device, single.round, KIND_TRAIN, *encode_update(arrays, single.trainable_layout, n, cluster))
            single.apply(device, single.parse_result(decode(raw)))
            updates[device] = (cluster, *model_of_update(single, arrays), n)
            if coordinator:
                receipt = feed(shards[shard_of(device, shards_count)], device, raw)
                assert isinstance(receipt, Receipt)
                coordinator.apply(device, coordinator.parse_result(decode(receipt.raw)))
                applied.append((device, decode(receipt.raw)))
        if coordinator and t == restart_round:
            coordinator = restarted(coordinator, checkpoint, bookkeeping, applied)
        closed = RoundClosed(single.round, tuple(chosen), (), (), ())
        single.close_round(closed)
        if coordinator:
            coordinator.close_round(closed)
            checkpoint = (coordinator.state_dict(), dict(coordinator.contributed))
        played.append((start, updates))
    return single, coordinator.inner if coordinator else None, played


def model_of_update(job, arrays):
    phi_names = [k for k in job.trainable if not job.is_theta(k)]
    theta_names = [k for k in job.trainable if job.is_theta(k)]
    return flat(arrays, phi_names), flat(arrays, theta_names)


def assert_as_numpy_says(job, played, small_only: bool = False):
    """Each training round's model against :func:`numpy_round` from the model it started at (``small_only``:
    rounds of fewer than three updates only, where a whole-round rule averages as the mean does)."""
    references = (NumpyReference(), NumpyReference())
    afters = [start for start, _ in played[1:]] + [model_of(job)]
    for (start, updates), after in zip(played, afters):
        want = numpy_round(references, start, updates)
        if small_only and len(updates) >= 3:
            continue
        np.testing.assert_allclose(after[0], want[0], rtol=1e-5, atol=1e-6)
        for c in want[1]:
            np.testing.assert_allclose(after[1][c], want[1][c], rtol=1e-5, atol=1e-6)


def lone_rounds_steps(job, played):
    """(φ's step, the attacker's θ_c's step) of each round the attacker answered alone, and the
    largest honest φ and θ update norm of the rounds before it."""
    afters = [start for start, _ in played[1:]] + [model_of(job)]
    out, honest_phi, honest_theta = [], [0.0], [0.0]
    for (start, updates), after in zip(played, afters):
        if list(updates) == [EVIL]:
            c = updates[EVIL][0]
            out.append((float(np.linalg.norm(after[0] - start[0])), float(np.linalg.norm(after[1][c] - start[1][c])),
                        max(honest_phi), max(honest_theta)))
        for d, (c, phi, theta, _n) in updates.items():
            if d != EVIL:
                honest_phi.append(float(np.linalg.norm(phi - start[0])))
                honest_theta.append(float(np.linalg.norm(theta - start[1][c])))
    return out


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_device_alone_in_a_ladd_round_is_bounded_by_the_reference_of_earlier_rounds(tmp_path, scenario):
    """The review's attack on LADD: a device alone in a training round moved φ (and its cluster's θ_c)
    to its own 9·10^3 entries. Now each lone round moves φ and θ_c by at most 3x the typical honest
    update of the reference's rounds, and nothing before a reference exists (against numpy)."""
    job, _, played = play(tmp_path, SCENARIOS[scenario])
    assert_as_numpy_says(job, played)
    lone = lone_rounds_steps(job, played)
    assert lone
    for phi_step, theta_step, honest_phi, honest_theta in lone:
        assert phi_step <= NORM * honest_phi * (1 + 1e-5) and theta_step <= NORM * honest_theta * (1 + 1e-5)
    if scenario == "alone first":
        assert lone[0][:2] == (0.0, 0.0)            # no reference yet: the round moved nothing
    assert lone[-1][0] > 0 and lone[-1][1] > 0      # with one: bounded, not dropped


@pytest.mark.parametrize("scenario", ["alone first", "pooled"])
def test_ladd_on_shards_keeps_the_reference_as_one_aggregator_does(tmp_path, scenario):
    """The coordinator decides each slot's limits on the shards' statistics within its job's
    references and closes the round into them, as one aggregator's job does: the same bytes, the
    checkpoint included, with the coordinator rebuilt from its last checkpoint halfway through the
    attacker's lone round (whose bound comes from the references that checkpoint holds)."""
    from aggregator.strategies.ladd_small_rounds import LaddSmallRounds

    rounds = SCENARIOS[scenario]
    lone = max(t for t, answering in enumerate(rounds, start=1) if answering == [EVIL])
    single, coordinated, played = play(tmp_path, rounds, shards_count=2, restart_round=lone)
    assert_as_numpy_says(single, played)
    assert_same_job(single, coordinated, restarted=True)
    state = coordinated.state_dict()
    assert any(k.startswith("unreleased_" + LaddSmallRounds.PHI_KEY) for k in state)
    assert any(k.startswith("unreleased_" + LaddSmallRounds.THETA_KEY) for k in state)


@pytest.mark.parametrize("over", [{"direction_screen": True}, {"aggregator": "median"}],
                         ids=["direction screen", "median rule"])
def test_the_whole_round_path_bounds_a_lone_device_by_the_same_reference(tmp_path, over):
    """A robust rule or the direction screen combines each slot's updates in one place
    (``RobustClusterAveraging``): its rounds of fewer than three updates take the same references
    (the screen leaves such rounds whole, so they are numpy's mean; a median of one update is it)."""
    for scenario in ("alone first", "two first"):
        job, _, played = play(tmp_path / scenario.replace(" ", "_"), SCENARIOS[scenario], **over)
        if "direction_screen" in over:
            assert_as_numpy_says(job, played, small_only=True)
        lone = lone_rounds_steps(job, played)
        for phi_step, theta_step, honest_phi, honest_theta in lone:
            assert phi_step <= NORM * honest_phi * (1 + 1e-5) and theta_step <= NORM * honest_theta * (1 + 1e-5)
        assert lone[-1][0] > 0 and lone[-1][1] > 0
        if scenario == "alone first":
            assert lone[0][:2] == (0.0, 0.0)


def test_rounds_of_three_or_more_updates_are_the_same_bits_with_the_reference_on_and_off(tmp_path):
    """The references only bound rounds of fewer than three updates; off (the choice for a fleet that
    answers one device at a time), a lone device's round is its own again, within each slot's bounds."""
    rounds = [FULL, [EVIL, "d2", "d4"], ["d0", "d3", "d5", "d6"], FULL]
    on, _, _ = play(tmp_path / "on", rounds)
    off, _, _ = play(tmp_path / "off", rounds, small_round_reference=False)
    state_on, state_off = on.state_dict(), off.state_dict()
    assert {k for k in state_on.keys() - state_off.keys() if not k.startswith("unreleased_ladd.")} == set()
    for key, value in state_off.items():
        assert np.asarray(value).tobytes() == np.asarray(state_on[key]).tobytes(), key
    lone, _, played = play(tmp_path / "lone", [FULL, [EVIL]], small_round_reference=False)
    np.testing.assert_array_equal(model_of(lone)[0], np.full_like(played[1][0][0], EVIL_ENTRY))


def test_the_flag_defaults_on_as_the_fedavg_familys_and_is_off_under_dp():
    """``small_round_reference`` is LADD's as the FedAvg family's: on by default, false accepted, a
    value that is not a bool refused; under DP-LADD (the clipped, noised sums use no bound layer)
    and with every bound layer off there is nothing to bound: off."""
    from aggregator.jobs.ladd_config import LaddConfig
    from aggregator.strategies.ladd_small_rounds import LaddSmallRounds

    model = {"num_classes": 2, "image_size": 16}
    assert LaddConfig(model=model).small_round_reference
    on = LaddSmallRounds.of(LaddConfig(model=model))
    assert on.phi.enabled and on.theta.enabled and on.phi.keys != on.theta.keys
    for config in (LaddConfig(model=model, small_round_reference=False),
                   LaddConfig(model=model, dp_noise_multiplier=1.0),
                   LaddConfig(model=model, norm_bound_multiplier=0.0, weight_bound_multiplier=0.0)):
        off = LaddSmallRounds.of(config)
        assert not off.phi.enabled and not off.theta.enabled
    with pytest.raises(ValueError, match="small_round_reference"):
        LaddConfig(model=model, small_round_reference="yes")


def test_a_whole_round_with_an_unknown_cluster_is_refused_before_the_references_take_it():
    """Bad input gets one clear error and changes nothing: the φ reference is not closed over a round
    the θ part then refuses."""
    from aggregator.jobs.ladd_config import LaddConfig
    from aggregator.strategies.ladd import cluster_specific_predicate
    from aggregator.strategies.ladd_small_rounds import LaddSmallRounds
    from aggregator.strategies.robust_ladd import RobustClusterAveraging

    config = LaddConfig(model={"num_classes": 2, "image_size": 16}, direction_screen=True)
    small_rounds = LaddSmallRounds.of(config)
    is_theta = cluster_specific_predicate("head")
    robust = RobustClusterAveraging(is_theta, config.robust_aggregation(), small_rounds)
    robust.add(5, {"tail.w": np.ones(3), "head.w": np.ones(2)}, 10, device="d0")
    with pytest.raises(ValueError, match="unknown cluster 5"):
        robust.result({"tail.w": np.zeros(3)}, {0: {"head.w": np.zeros(2)}})
    assert small_rounds.state_dict() == {} and not small_rounds.phi.pool
