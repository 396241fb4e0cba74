"""FedAvg(ψ)'s default pipeline (norm bound, contribution bound, direction screen, mean, round
history) as one numpy reference over rounds, the round history's exponential average, and the
history surviving a checkpoint."""

import numpy as np

from aggregator.jobs.registry import build_job
from aggregator.strategies.robust_fedavg import RoundHistory
from protocols.rounds import RoundClosed

from robust_fedavg_reference import as_matrix, contribution_bound_reference, fixed_updates


def default_pipeline_reference(x0, rounds, beta=0.7, contribution=0.5):
    """FedAvg(ψ)'s defaults written out in numpy: per round, clip Δ_k to the median norm, bound
    w_k·‖Δ_k‖ by contribution × its median, keep ⟨Δ_k, median Δ⟩ > 0, a = Σ w Δ / Σ w over those
    kept, s = a (first round) or β s + (1 − β) a, x ← x + s."""
    x, s = x0.astype(np.float64), None
    for ups in rounds:
        d = as_matrix(ups) - x
        norms = np.linalg.norm(d, axis=1)
        d = d * np.minimum(1.0, np.median(norms) / norms)[:, None]
        w = contribution_bound_reference(d, np.array([n for _, n in ups], dtype=float), contribution)
        keep = d @ np.median(d, axis=0) > 0
        a = (w[keep, None] * d[keep]).sum(0) / w[keep].sum()
        s = a if s is None else beta * s + (1 - beta) * a
        x = (x + s).astype(np.float32)         # the job keeps the head in float32
    return x


def job_rounds(job, rounds):
    for ups in rounds:
        job.next_participants({f"d{i}" for i in range(len(ups))})
        job._updates = {f"d{i}": u for i, u in enumerate(ups)}
        job.close_round(RoundClosed(job.round, tuple(job._updates), (), (), ()))


def outlier_rounds():
    """Three rounds of 7 updates; one device sends a large, sign-flipped update with a large count."""
    rounds = []
    for r in range(3):
        ups = fixed_updates(seed=10 + r)
        ups[2] = ({k: -8 * v for k, v in ups[2][0].items()}, 400)
        rounds.append(ups)
    return rounds


def test_the_default_pipeline_equals_the_numpy_reference_over_rounds():
    job = build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, "init": "zeros", "rounds": 3})
    rounds = outlier_rounds()
    _, report = job.config.robust_aggregation().aggregate(job.params, rounds[0])
    assert report["norm_bounded"] and report["weight_bounded"] and report["screened"]    # every layer acts
    job_rounds(job, rounds)
    got = as_matrix([({"weight": job.params["weight"], "bias": job.params["bias"]}, 1)])[0]
    np.testing.assert_allclose(got, default_pipeline_reference(np.zeros(8), rounds), rtol=1e-5, atol=1e-6)


def test_the_round_history_survives_a_checkpoint():
    """A job resumed from round 2's checkpoint ends where the uninterrupted one does, bit for bit;
    without the history's state it would not."""
    cfg = {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, "init": "zeros", "rounds": 3}
    rounds = outlier_rounds()
    whole, first = build_job("fedavg", cfg), build_job("fedavg", cfg)
    job_rounds(whole, rounds)
    job_rounds(first, rounds[:2])
    state = first.state_dict()
    assert "history.step" in state
    resumed, forgetful = build_job("fedavg", cfg), build_job("fedavg", cfg)
    resumed.load_state_dict(state)
    forgetful.load_state_dict({k: v for k, v in state.items() if not k.startswith("history.")})
    job_rounds(resumed, rounds[2:])
    job_rounds(forgetful, rounds[2:])
    assert all(np.array_equal(resumed.params[k], whole.params[k]) for k in whole.params)
    assert not np.array_equal(forgetful.params["weight"], whole.params["weight"])


def test_round_history_is_the_exponential_average_of_the_steps():
    history, x = RoundHistory(0.7), {"w": np.zeros(3)}
    steps = [np.array([1.0, 0.0, 2.0]), np.array([-1.0, 4.0, 0.0]), np.array([0.5, 0.5, 0.5])]
    want = steps[0]
    assert np.array_equal(history.step(x, {"w": steps[0]})["w"], want)
    for a in steps[1:]:
        want = 0.7 * want + 0.3 * a
        np.testing.assert_allclose(history.step(x, {"w": a})["w"], want, rtol=1e-15)
    combined = {"w": steps[0]}
    assert RoundHistory(0.0).step(x, combined) is combined and RoundHistory(0.0).state_dict() == {}     # off
