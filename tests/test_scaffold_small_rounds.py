"""Scaffold's server control c in rounds of fewer than three Δc: bounded by a reference of earlier
rounds' Δc bounds (``SmallRoundReference`` under the key ``scaffold.control_bounds``), as the model
update of such a round is by the FedAvg family's own reference.

A review's finding: the Δc bound (``ControlBound``) is a multiple of the round's median ‖Δc‖, which
in a round of one is the device's own, so a lone device sending Δc at the wire's largest entry
(2^20) moved c by control_clip_norm / K (1000 / 4 = 250 here) every round it was alone, where an
honest device moves it by about 1 / K; two colluding devices in a round of two by twice that. Each
step below is recomputed in numpy from what the devices sent (the clip, the lower median, K)."""

import numpy as np
import pytest

from aggregator.jobs.scaffold import ScaffoldConfig, ScaffoldJob
from protocols.payloads.fedavg import MAX_ABS_TRAINED
from protocols.payloads.scaffold import DELTA_CONTROL, KIND

from stateful_jobs import run_round
from test_scaffold import C, D, SIZE, device

NAMES = ("weight", "bias")
CONTROL_LIMITS = "unreleased_scaffold.control_bounds.reference"


def make_job(**over) -> ScaffoldJob:
    """Defaults but the direction screen (so that numpy's reference bound is the lower median of all)."""
    return ScaffoldJob(ScaffoldConfig(**{"num_classes": C, "feature_dim": D, "image_size": SIZE, "clients_per_round": 4,
                                         "rounds": 8, "batch_size": 8, "client_lr": 0.05, "total_devices": 4,
                                         "direction_screen": False, **over}))


def fleet(root, count: int = 4) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    return {f"dev{i}": device(i, root) for i in range(count)}


def hostile(*devices):
    """The attackers' Δc: every entry at the largest the wire accepts (2^20), the same direction."""
    def tamper(d, out):
        if d not in devices:
            return out
        return {**out, **{DELTA_CONTROL + k: np.full_like(out[DELTA_CONTROL + k], MAX_ABS_TRAINED) for k in NAMES}}
    return tamper


def norm(tensors) -> float:
    return float(np.sqrt(sum(np.sum(np.asarray(t, np.float64) ** 2) for t in tensors.values())))


def control(job) -> dict:
    return {k: job.control[k].astype(np.float64) for k in NAMES}


def moved(before: dict, job) -> dict:
    return {k: job.control[k].astype(np.float64) - before[k] for k in NAMES}


def deltas_of(sent: dict, clip: float = 1000.0) -> dict:
    """device -> its Δc as the server takes it: float64, clipped to ``control_clip_norm``."""
    out = {}
    for d, (_, _, _, result) in sent.items():
        t = {k: result[DELTA_CONTROL + k].astype(np.float64) for k in NAMES}
        out[d] = scaled(t, clip)
    return out


def lower_median(values) -> float:
    values = np.sort(np.asarray(list(values), np.float64))
    return float(values[(len(values) - 1) // 2])


def scaled(t: dict, limit: float) -> dict:
    """``t`` scaled to L2 norm ``limit`` when its norm exceeds it."""
    return {k: v * min(1.0, limit / norm(t)) if norm(t) else v for k, v in t.items()}


def test_a_lone_hostile_device_moves_c_no_further_than_the_reference_of_earlier_rounds(tmp_path):
    """Round 1: four honest devices (the reference: 1 × their lower-median ‖Δc‖). Round 2: dev0 alone,
    honest in one job and hostile in its twin. Before: the hostile round moved c by 1000 / 4 = 250
    (an honest one by ‖Δc_0‖ / 4 = 1.7); now by at most the reference / 4 (3.8 / 4), in the direction
    it sent."""
    honest_job, evil_job = make_job(), make_job()
    honest, evil = fleet(tmp_path / "honest"), fleet(tmp_path / "evil")
    first = run_round(honest_job, honest, KIND)
    run_round(evil_job, evil, KIND)
    for k in NAMES:
        np.testing.assert_array_equal(honest_job.control[k], evil_job.control[k])     # twins so far
    reference = 1.0 * lower_median(norm(t) for t in deltas_of(first).values())
    c1 = control(honest_job)

    lone = run_round(honest_job, honest, KIND, only=["dev0"])
    attacked = run_round(evil_job, evil, KIND, only=["dev0"], tamper=hostile("dev0"))
    honest_step, evil_step = moved(c1, honest_job), moved(c1, evil_job)
    sent = deltas_of(attacked)["dev0"]
    assert norm(sent) == pytest.approx(1000.0)              # what the clip alone let through: 250 in c
    for k in NAMES:                                          # c + (1 / K) · Δc within the reference, K = 4
        np.testing.assert_allclose(evil_step[k], scaled(sent, reference)[k] / 4, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(honest_step[k], scaled(deltas_of(lone)["dev0"], reference)[k] / 4,
                                   rtol=1e-5, atol=1e-6)
    assert norm(evil_step) == pytest.approx(reference / 4, rel=1e-5)
    assert norm(evil_step) < 2 * max(norm(honest_step), reference / 4)
    assert CONTROL_LIMITS in evil_job.state_dict()


def test_two_colluding_devices_in_a_round_of_two_are_bounded_by_the_reference_too(tmp_path):
    """A round of two: each Δc's bound is the smaller of the pair's, so two colluders sending the
    wire's largest Δc moved c by 2 · 1000 / 4 = 500; now each is within the earlier rounds' reference."""
    job, handlers = make_job(), fleet(tmp_path)
    first = run_round(job, handlers, KIND)
    reference = lower_median(norm(t) for t in deltas_of(first).values())
    c1 = control(job)
    attacked = run_round(job, handlers, KIND, only=["dev0", "dev1"], tamper=hostile("dev0", "dev1"))
    step = moved(c1, job)
    bounded = [scaled(t, reference) for t in deltas_of(attacked).values()]
    for k in NAMES:
        np.testing.assert_allclose(step[k], sum(t[k] for t in bounded) / 4, rtol=1e-5, atol=1e-6)
    assert norm(step) == pytest.approx(2 * reference / 4, rel=1e-5)


def test_a_job_of_lone_devices_takes_its_control_reference_from_three_devices_rounds(tmp_path):
    """κ = 1: the first rounds move no c (nor the model) until three distinct devices have sent their
    ‖Δc‖; the lower median of those three (one of them the attacker's 1000) is the reference, and
    the attacker's later lone rounds move c by at most it / K."""
    job, handlers = make_job(clients_per_round=1, total_devices=3), fleet(tmp_path, 3)
    pool = []
    for d, tamper in (("dev0", hostile("dev0")), ("dev1", None), ("dev2", None)):
        before = control(job)
        sent = run_round(job, handlers, KIND, only=[d], tamper=tamper)
        assert norm(moved(before, job)) == 0.0
        pool += [norm(t) for t in deltas_of(sent).values()]
    reference = lower_median(pool)
    assert pool[0] == pytest.approx(1000.0) and reference < 10
    for _ in range(3):
        before = control(job)
        sent = run_round(job, handlers, KIND, only=["dev0"], tamper=hostile("dev0"))
        step = moved(before, job)
        for k in NAMES:
            np.testing.assert_allclose(step[k], scaled(deltas_of(sent)["dev0"], reference)[k] / 3,
                                       rtol=1e-5, atol=1e-6)
        assert norm(step) == pytest.approx(reference / 3, rel=1e-5)


def test_a_lone_delta_without_a_usable_control_reference_moves_no_c_though_the_model_moves(tmp_path):
    """Round 1 of three in which two devices' Δc are 0: its Δc bound is 0 (no bound: the one nonzero Δc
    is kept), so no control reference exists though the model's does. A lone hostile device then
    moved c by 1000 / 3; now its round moves the model (within the model's reference) but not c."""
    job, handlers = make_job(clients_per_round=3, total_devices=3), fleet(tmp_path, 3)

    def zero_but_dev2(d, out):
        return out if d == "dev2" else {**out, **{DELTA_CONTROL + k: np.zeros_like(out[DELTA_CONTROL + k])
                                                  for k in NAMES}}

    first = run_round(job, handlers, KIND, tamper=zero_but_dev2)
    for k in NAMES:                                 # the 0 limit bounded nothing: dev2's Δc / 3 is in c
        np.testing.assert_allclose(job.control[k], deltas_of(first)["dev2"][k] / 3, rtol=1e-5, atol=1e-7)
    c1, w1 = control(job), {k: job.params[k].copy() for k in NAMES}
    run_round(job, handlers, KIND, only=["dev0"], tamper=hostile("dev0"))
    assert norm(moved(c1, job)) == 0.0
    assert any(not np.array_equal(job.params[k], w1[k]) for k in NAMES)
    assert job.round_log[-1]["updates"] == 1


def test_the_control_reference_is_in_the_checkpoint_and_a_restored_job_goes_on_bit_for_bit(tmp_path):
    """The reference and its pool come back from ``state_dict``: a job rebuilt from its checkpoint
    after every round (as a restart rebuilds it) closes the same lone rounds, an attacker's among
    them, to the same bytes as its twin that ran on."""
    ran, ran_devices = make_job(clients_per_round=1, total_devices=3), fleet(tmp_path / "ran", 3)
    restarted, restarted_devices = make_job(clients_per_round=1, total_devices=3), fleet(tmp_path / "restarted", 3)
    for i, d in enumerate(["dev0", "dev1", "dev0", "dev2", "dev0", "dev1", "dev0"]):
        for job, devices in ((ran, ran_devices), (restarted, restarted_devices)):
            run_round(job, devices, KIND, only=[d], tamper=hostile("dev0"))
        state = restarted.state_dict()
        if i == 1:                              # two devices' ‖Δc‖ in the pool, no reference yet
            assert "unreleased_scaffold.control_bounds.pool" in state and CONTROL_LIMITS not in state
        rebuilt = make_job(clients_per_round=1, total_devices=3)
        rebuilt.load_state_dict(state)
        rebuilt.contributed = dict(restarted.contributed)       # the service restores it from the store
        restarted = rebuilt
    want, got = ran.state_dict(), restarted.state_dict()
    assert CONTROL_LIMITS in want and sorted(got) == sorted(want)
    for name in want:
        if name != "device_state_run":          # each job draws its own run id
            assert got[name].tobytes() == want[name].tobytes(), name
    assert norm(control(ran)) > 0


@pytest.mark.parametrize("state,entry", [
    ({CONTROL_LIMITS: np.ones(2)}, CONTROL_LIMITS),
    ({CONTROL_LIMITS: np.array([np.inf])}, CONTROL_LIMITS),
    ({"unreleased_scaffold.control_bounds.pool_devices": np.array(["dev0"])},
     "unreleased_scaffold.control_bounds.pool"),
])
def test_a_checkpoint_with_a_control_reference_this_job_could_not_write_is_refused_naming_it(tmp_path, state, entry):
    job = make_job()
    run_round(job, fleet(tmp_path), KIND)
    with pytest.raises(ValueError, match=entry):
        make_job().load_state_dict({**job.state_dict(), **state})


def test_a_checkpoint_of_the_version_before_the_control_reference_resumes_as_one_taken_before_it(tmp_path):
    """A Scaffold checkpoint without ``scaffold.control_bounds`` entries loads as a job whose Δc reference
    is still to be made: the next lone round moves no c, and its ‖Δc‖ starts the pool again."""
    job, handlers = make_job(), fleet(tmp_path)
    run_round(job, handlers, KIND)
    old = {k: v for k, v in job.state_dict().items() if "control_bounds." not in k}
    resumed = make_job()
    resumed.load_state_dict(old)
    resumed.contributed = dict(job.contributed)
    assert resumed.control_rounds.limits is None and not resumed.control_rounds.pool
    before = control(resumed)
    run_round(resumed, handlers, KIND, only=["dev0"], tamper=hostile("dev0"))
    assert norm(moved(before, resumed)) == 0.0
    assert list(resumed.control_rounds.pool) == ["dev0"]


def test_off_with_small_round_reference_false_as_the_models_reference_is(tmp_path):
    """The operator's switch (a fleet of one or two devices answering alone): off, a lone device's
    Δc is bounded by its clip alone, as before the reference (1000 / 4 here); on by default."""
    on, off = make_job(), make_job(small_round_reference=False)
    assert on.control_rounds.enabled and not off.control_rounds.enabled
    assert not make_job(norm_bound_multiplier=0.0).control_rounds.enabled       # no Δc bound to take a reference of
    handlers = fleet(tmp_path)
    run_round(off, handlers, KIND)
    before = control(off)
    run_round(off, handlers, KIND, only=["dev0"], tamper=hostile("dev0"))
    assert norm(moved(before, off)) == pytest.approx(1000.0 / 4, rel=1e-5)
    assert not any("control_bounds" in k for k in off.state_dict())
