"""Server SWA and WiMA (aggregator/strategies/model_averaging.py) against plain numpy means of the
rounds' models, their checkpoint, the cyclical client LR, and a job serving them."""

import numpy as np
import pytest

from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.jobs.registry import build_job
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.strategies.model_averaging import LastModel, StochasticWeightAveraging, WindowAverage
from protocols.rounds import RoundClosed

C, D = 3, 4


def models(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"weight": rng.normal(size=(C, D)).astype(np.float32), "bias": rng.normal(size=C).astype(np.float32)}
            for _ in range(n)]


@pytest.mark.parametrize("start, cycle", [(1, 1), (3, 2), (2, 4)])
def test_swa_is_the_mean_of_each_cycles_last_model(start, cycle):
    ws = models(12)
    swa = StochasticWeightAveraging(start, cycle)
    for t, w in enumerate(ws, start=1):
        swa.observe(t, w)
        folded = [ws[r - 1] for r in range(1, t + 1) if r >= start and (r - start) % cycle == cycle - 1]
        served = swa.served(w)
        want = w if not folded else {k: np.mean([m[k].astype(np.float64) for m in folded], axis=0) for k in w}
        for k in w:
            assert served[k].dtype == np.float32
            np.testing.assert_allclose(served[k], want[k], rtol=1e-6, atol=1e-7)
    assert swa.count == len(folded)


def test_swa_client_lr_cycles_from_the_jobs_down_to_the_lowest():
    """Thesis 001 Eq. 2.36–2.37: γ(i) = (1 − t)γ₁ + tγ₂, t = (mod(i−1, c) + 1)/c, i counted from t₀
    (a review found a ramp of i/(c−1): each cycle started at γ₁)."""
    swa = StochasticWeightAveraging(start_round=3, cycle_rounds=3, lr_min=0.01)
    lrs = [swa.client_lr(t, 0.1) for t in range(1, 10)]
    paper = [0.1, 0.1] + [(1 - t) * 0.1 + t * 0.01 for t in [1 / 3, 2 / 3, 1] * 2 + [1 / 3]]
    np.testing.assert_allclose(lrs, paper)
    np.testing.assert_allclose(lrs[2:5], [0.07, 0.04, 0.01])
    assert StochasticWeightAveraging(1, 5).client_lr(4, 0.1) == 0.1          # no γ₂: constant
    assert StochasticWeightAveraging(1, 1, lr_min=0.01).client_lr(4, 0.1) == 0.01     # c = 1: the constant γ₂


@pytest.mark.parametrize("window", [1, 3, 5])
def test_wima_is_the_mean_of_the_last_w_models(window):
    ws = models(8, seed=1)
    wima = WindowAverage(window)
    wima.observe(0, ws[0])                     # the initial model is not a round's
    for t, w in enumerate(ws, start=1):
        wima.observe(t, w)
        last = ws[max(0, t - window):t]
        served = wima.served(w)
        for k in w:
            np.testing.assert_allclose(served[k], np.mean([m[k].astype(np.float64) for m in last], axis=0),
                                       rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make", [lambda: StochasticWeightAveraging(2, 2), lambda: WindowAverage(3), LastModel])
def test_restored_state_serves_and_continues_identically(make):
    ws = models(9, seed=2)
    straight, first = make(), make()
    for t, w in enumerate(ws, start=1):
        straight.observe(t, w)
    for t, w in enumerate(ws[:5], start=1):
        first.observe(t, w)
    resumed = make()
    resumed.load_state_dict({k: np.array(v) for k, v in first.state_dict().items()})
    for t, w in enumerate(ws[5:], start=6):
        resumed.observe(t, w)
    for k, v in straight.served(ws[-1]).items():
        np.testing.assert_array_equal(resumed.served(ws[-1])[k], v)


def test_bad_settings_are_refused():
    for bad in ({"served_model": "ema"}, {"served_model": "swa", "swa_start_round": 0},
                {"served_model": "wima", "wima_window": 0}, {"wima_window": 5000}):
        with pytest.raises(ValueError):
            build_job("fedavg", {"num_classes": C, "feature_dim": D, **bad})
    with pytest.raises(ValueError, match="served_model"):
        build_job("fedavg-async", {"num_classes": C, "feature_dim": D, "served_model": "wima"})


def test_job_serves_and_checkpoints_the_window_average_and_trains_on_the_last_model():
    cfg = FedAvgConfig(num_classes=C, feature_dim=D, rounds=4, clients_per_round=1, served_model="wima",
                       wima_window=2, **PLAIN_MEAN)
    job = FedAvgJob(cfg)
    rng = np.random.default_rng(4)
    rounds = []
    for _ in range(3):
        job.next_participants({"d"})
        params, head = job.task_for("d")
        np.testing.assert_array_equal(head["weight"], job.params["weight"])    # devices train w^t, not the mean
        job._updates["d"] = ({k: v + rng.normal(size=v.shape).astype(np.float32) for k, v in head.items()}, 5)
        job.close_round(_closed(job.round))
        rounds.append({k: v.copy() for k, v in job.params.items()})
    served = job.model_arrays()
    np.testing.assert_allclose(served["weight"], (rounds[-1]["weight"].astype(np.float64) + rounds[-2]["weight"]) / 2,
                               rtol=1e-6)
    clone = FedAvgJob(cfg)
    clone.load_state_dict(job.state_dict())
    np.testing.assert_array_equal(clone.params["weight"], job.params["weight"])
    np.testing.assert_array_equal(clone.model_arrays()["weight"], served["weight"])


def _closed(round_):
    return RoundClosed(round_, ("d",), (), (), ())


def test_swa_job_sends_the_cyclical_lr():
    job = build_job("fedavg", {"num_classes": C, "feature_dim": D, "rounds": 5, "clients_per_round": 1,
                               "client_lr": 0.1, "served_model": "swa", "swa_start_round": 2, "swa_cycle_rounds": 2,
                               "swa_lr_min": 0.02, **PLAIN_MEAN})
    lrs = []
    for _ in range(4):
        job.next_participants({"d"})
        lrs.append(job.task_for("d")[0]["lr"])
        job.close_round(_closed(job.round))
    np.testing.assert_allclose(lrs, [0.1, 0.06, 0.02, 0.06])      # t = 1/2, 1 over each cycle of 2


def test_a_window_too_large_for_its_model_is_refused_at_creation():
    """A review's finding: WiMA keeps every model of its window in memory and in each checkpoint,
    and each limit alone was met by 26,000 classes x 1,281 inputs with a window of 1,000 (124 GiB).
    The window times the head's entries is bounded now (1 GiB of float32); smaller ones build."""
    from aggregator.jobs.optimizer_fields import MAX_WINDOW_ENTRIES

    with pytest.raises(ValueError, match="wima_window x the model's 33,306,000 entries"):
        build_job("fedavg", {"num_classes": 26_000, "feature_dim": 1280, "served_model": "wima", "wima_window": 1000})
    most = MAX_WINDOW_ENTRIES // (26_000 * 1281)
    build_job("fedavg", {"num_classes": 26_000, "feature_dim": 1280, "served_model": "wima", "wima_window": most})
    with pytest.raises(ValueError, match=f"at most {most} rounds"):
        build_job("fedavg", {"num_classes": 26_000, "feature_dim": 1280, "served_model": "wima", "wima_window": most + 1})
    build_job("fedavg", {"num_classes": 26_000, "feature_dim": 1280, "served_model": "last", "wima_window": 1000})
