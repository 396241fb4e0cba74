"""FedAvg / FedAvgM strategies, the fedavg.head codec and the FedAvg job's round discipline."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from aggregator.compute.evaluation import head_accuracy, weighted_mean_accuracy
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob, random_head
from aggregator.compute.ridge import ClosedFormRidge
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.strategies.fedavg import FedAvg, FedAvgM, WeightedMean
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from protocols import messages as M
from protocols.envelope import Envelope, EnvelopeError, decode, encode
from protocols.payloads.fedavg import KIND, encode_head_update, parse_head_update
from protocols.rounds import ApplyResult, ResultArrived, RoundClosed, RoundCoordinator, SendAck, Tick

C, D = 4, 6


def head(rng, scale=1.0):
    return {"weight": (scale * rng.normal(size=(C, D))).astype(np.float32),
            "bias": (scale * rng.normal(size=C)).astype(np.float32)}


# ----------------------------------------------------------------------------- strategies
@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 12), seed=st.integers(0, 2**31 - 1), ns=st.lists(st.integers(1, 10**6), min_size=12, max_size=12))
def test_fedavg_of_identical_updates_is_the_identity(k, seed, ns):
    rng = np.random.default_rng(seed)
    x = head(rng, scale=rng.uniform(1e-3, 1e3))
    start = head(rng)
    new = FedAvg().step(start, FedAvg.mean([(x, n) for n in ns[:k]]))
    for name in x:
        assert new[name].dtype == np.float32
        np.testing.assert_array_equal(new[name], x[name])


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 10), seed=st.integers(0, 2**31 - 1))
def test_weights_follow_sample_counts(k, seed):
    rng = np.random.default_rng(seed)
    updates = [head(rng) for _ in range(k)]
    ns = rng.integers(1, 5000, size=k)
    mean = FedAvg.mean(list(zip(updates, ns.tolist())))
    for name in ("weight", "bias"):
        ref = np.average(np.stack([u[name].astype(np.float64) for u in updates]), axis=0, weights=ns)
        np.testing.assert_allclose(mean[name], ref, rtol=1e-12, atol=1e-12)


def test_large_sample_count_dominates_and_order_does_not_matter():
    rng = np.random.default_rng(1)
    a, b = head(rng), head(rng)
    m1 = FedAvg.mean([(a, 1), (b, 999)])
    m2 = FedAvg.mean([(b, 999), (a, 1)])
    for name in a:
        np.testing.assert_allclose(m1[name], m2[name], rtol=1e-15)
        np.testing.assert_allclose(m1[name], (a[name] + 999.0 * b[name].astype(np.float64)) / 1000, rtol=1e-12)


def test_momentum_matches_hand_computed_sequence():
    # x0 = 1, round means 0.5, 0.25, 0.4; β = 0.9, η = 1:
    #   v1 = 0.5                     x1 = 1 - 0.5   = 0.5
    #   v2 = 0.9·0.5 + (0.5-0.25) = 0.7     x2 = 0.5 - 0.7  = -0.2
    #   v3 = 0.9·0.7 + (-0.2-0.4) = 0.03    x3 = -0.2 - 0.03 = -0.23
    # and with η = 0.5: v1 = 0.5, x1 = 0.75; v2 = 0.45 + 0.5 = 0.95, x2 = 0.275;
    #                   v3 = 0.855 + (-0.125) = 0.73, x3 = -0.09
    for lr, expected in ((1.0, [0.5, -0.2, -0.23]), (0.5, [0.75, 0.275, -0.09])):
        strategy = FedAvgM(server_lr=lr, momentum=0.9)
        x = {"w": np.array([1.0])}
        got = []
        for avg in (0.5, 0.25, 0.4):
            x = strategy.step(x, {"w": np.array([avg])})
            got.append(float(x["w"][0]))
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


def test_momentum_equals_torch_sgd_on_the_pseudo_gradient():
    rng = np.random.default_rng(2)
    x = head(rng)
    p = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.float64)) for k, v in x.items()}
    opt = torch.optim.SGD(list(p.values()), lr=0.7, momentum=0.9)
    strategy = FedAvgM(server_lr=0.7, momentum=0.9)
    ours = {k: v.astype(np.float64) for k, v in x.items()}
    for _ in range(5):
        avg = {k: v + rng.normal(size=v.shape) for k, v in ours.items()}
        for k in p:                                   # gradient = x_t - mean
            p[k].grad = p[k].detach() - torch.from_numpy(avg[k])
        opt.step()
        ours = strategy.step(ours, avg)
        for k in p:
            np.testing.assert_allclose(ours[k], p[k].detach().numpy(), rtol=1e-12, atol=1e-12)


def test_strategy_state_round_trips():
    rng = np.random.default_rng(3)
    s = FedAvgM(momentum=0.9)
    x = head(rng)
    x = s.step(x, head(rng))
    s2 = FedAvgM(momentum=0.9)
    s2.load_state_dict(s.state_dict())
    avg = head(rng)
    a, b = s.step(x, avg), s2.step(x, avg)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_weighted_mean_rejects_bad_weights(bad):
    with pytest.raises(ValueError):
        WeightedMean().add({"w": np.zeros(2)}, bad)


def test_weighted_mean_rejects_nan_and_shape_mismatch():
    acc = WeightedMean()
    with pytest.raises(ValueError, match="NaN"):
        acc.add({"w": np.array([np.nan, 1.0])}, 1)
    acc.add({"w": np.zeros(2)}, 1)
    with pytest.raises(ValueError, match="shape"):
        acc.add({"w": np.zeros(3)}, 1)
    with pytest.raises(ValueError, match="tensors"):
        acc.add({"v": np.zeros(2)}, 1)
    with pytest.raises(ValueError):
        WeightedMean().result()


@pytest.mark.parametrize("kwargs", [{"server_lr": 0}, {"server_lr": float("nan")}, {"momentum": 1.0},
                                    {"momentum": -0.1}])
def test_strategy_rejects_bad_hyperparameters(kwargs):
    with pytest.raises(ValueError):
        FedAvg(**kwargs)


# ----------------------------------------------------------------------------- codec
def wire_result(device, weight, bias, n, round_=1, job="fedavg"):
    body, tensors = encode_head_update(weight, bias, n)
    ref = M.TaskRef(job, round_, "task-id")
    return decode(encode(M.result_message(device, ref, KIND, body, tensors)))


def test_codec_round_trip():
    rng = np.random.default_rng(4)
    h = head(rng)
    upd = parse_head_update(wire_result("d", h["weight"], h["bias"], 37), C, D)
    assert upd.n == 37
    np.testing.assert_array_equal(upd.weight, h["weight"])
    np.testing.assert_array_equal(upd.bias, h["bias"])


def _tamper(env: Envelope, **changes) -> Envelope:
    body = {**env.body, **changes.pop("body", {})}
    tensors = {**env.tensors, **changes.pop("tensors", {})}
    for name in changes.pop("drop", ()):
        tensors.pop(name)
    return Envelope(env.type, env.sender, body, tensors)


@pytest.mark.parametrize("change, match", [
    ({"body": {"n": 0}}, "out of range"),
    ({"body": {"n": "12"}}, "must be"),
    ({"body": {"num_classes": C + 1}}, "num_classes"),
    ({"body": {"feature_dim": D - 1}}, "feature_dim"),
    ({"tensors": {"weight": np.zeros((C, D + 1), np.float32)}}, "shape"),
    ({"tensors": {"weight": np.zeros((C, D), np.float64)}}, "dtype"),
    ({"tensors": {"bias": np.array([0, np.inf, 0, 0], np.float32)}}, "NaN or Inf"),
    ({"tensors": {"weight": np.full((C, D), np.nan, np.float32)}}, "NaN or Inf"),
    ({"tensors": {"extra": np.zeros(1, np.float32)}}, "unexpected"),
    ({"drop": ("bias",)}, "missing"),
])
def test_codec_rejects_malformed_updates(change, match):
    rng = np.random.default_rng(5)
    h = head(rng)
    env = _tamper(wire_result("d", h["weight"], h["bias"], 10), **change)
    with pytest.raises(EnvelopeError, match=match):
        parse_head_update(decode(encode(env)), C, D)


def test_encoder_refuses_diverged_heads():
    with pytest.raises(ValueError, match="NaN"):
        encode_head_update(np.full((C, D), np.nan), np.zeros(C), 3)
    with pytest.raises(ValueError):
        encode_head_update(np.zeros((C, D)), np.zeros(C + 1), 3)


# ----------------------------------------------------------------------------- job
def small_job(**kw):
    cfg = FedAvgConfig(num_classes=C, feature_dim=D, clients_per_round=kw.pop("kappa", 3), rounds=kw.pop("rounds", 5),
                       round_timeout_s=10.0, **kw)
    return FedAvgJob(cfg)


class Driver:
    """What aggregator.service.loop does with a job and its round machines, minus MQTT and clocks."""

    def __init__(self, job):
        self.job, self.rounds, self.acks = job, {}, []

    def open(self, online):
        chosen = self.job.next_participants(set(online))
        self.rounds[self.job.round] = RoundCoordinator(self.job.round, frozenset(chosen), deadline=100.0 * self.job.round)
        return chosen, {d: self.job.task_for(d) for d in chosen}

    def deliver(self, device, env):
        ref, _ = M.parse_result_ref(env)
        self.execute(self.rounds[ref.round].handle(ResultArrived(device, env.id, self.job.parse_result(env))))

    def tick(self, now):
        for coord in self.rounds.values():
            self.execute(coord.handle(Tick(now)))

    def execute(self, actions):
        for a in actions:
            if isinstance(a, ApplyResult):
                self.job.apply(a.device, a.result)
            elif isinstance(a, SendAck):
                self.acks.append((a.device, a.status))
            elif isinstance(a, RoundClosed):
                self.job.close_round(a)


def test_job_sends_the_global_head_and_averages_by_samples():
    job = small_job(kappa=3, rounds=1, **PLAIN_MEAN)     # FedAvg's own mean: the bounded-influence defaults off
    drv = Driver(job)
    chosen, tasks = drv.open([f"d{i}" for i in range(8)])
    assert len(chosen) == 3
    for params, tensors in tasks.values():
        np.testing.assert_array_equal(tensors["weight"], job.params["weight"])
        assert tensors["weight"].dtype == np.float32 and tensors["bias"].shape == (C,)
        assert params["lr"] == pytest.approx(0.1) and params["feature_dim"] == D
    rng = np.random.default_rng(6)
    sent = {d: (head(rng), int(rng.integers(1, 100))) for d in chosen}
    for d, (h, n) in sent.items():
        drv.deliver(d, wire_result(d, h["weight"], h["bias"], n))
    ns = np.array([n for _, n in sent.values()])
    ref = np.average(np.stack([h["weight"].astype(np.float64) for h, _ in sent.values()]), axis=0, weights=ns)
    np.testing.assert_allclose(job.params["weight"], ref.astype(np.float32), rtol=1e-6)
    assert job.contributions == 3 and job.finished(set(), set())
    assert job.next_participants({"d0"}) == []


def test_participation_is_seeded_and_partial():
    online = {f"d{i:02d}" for i in range(40)}
    a, b, c = small_job(seed=7, kappa=5), small_job(seed=7, kappa=5), small_job(seed=8, kappa=5)
    sa, sb, sc = [], [], []
    for job, out in ((a, sa), (b, sb), (c, sc)):
        for _ in range(3):
            out.append(job.next_participants(online))
            job.close_round(RoundClosed(job.round, (), tuple(out[-1]), (), ()))
    assert sa == sb and sa != sc and all(len(x) == 5 for x in sa)


def test_late_updates_never_enter_a_later_round():
    job = small_job(kappa=2, rounds=2, server_momentum=0.9, **PLAIN_MEAN)   # plain FedAvgM steps
    drv = Driver(job)
    rng = np.random.default_rng(9)
    (d1, d2), _ = drv.open(["a", "b"])
    h1, late = head(rng), head(rng)
    drv.deliver(d1, wire_result(d1, h1["weight"], h1["bias"], 5, round_=1))
    drv.tick(100.0)                                   # deadline: d2 is a straggler
    after_round1 = {k: v.copy() for k, v in job.params.items()}
    np.testing.assert_allclose(after_round1["weight"], h1["weight"], rtol=1e-6)    # only d1 averaged
    late_env = wire_result(d2, late["weight"], late["bias"], 1000, round_=1)
    drv.deliver(d2, late_env)                          # the round machine answers `late`
    assert (d2, "late") in drv.acks
    np.testing.assert_array_equal(job.params["weight"], after_round1["weight"])
    # Round 2 opens; the straggler's round-1 update slips past the round machine anyway.
    drv.open(["a", "b"])
    job.apply(d2, job.parse_result(late_env))
    assert job.late_discarded == 1
    g = {d: head(rng) for d in ("a", "b")}
    for d in ("a", "b"):
        drv.deliver(d, wire_result(d, g[d]["weight"], g[d]["bias"], 3, round_=2))
    mean2 = FedAvg.mean([(g["a"], 3), (g["b"], 3)])
    ref = FedAvgM(momentum=0.9)
    x = ref.step(random_head(C, D, 0), {k: v for k, v in h1.items()})
    x = ref.step(x, mean2)
    np.testing.assert_allclose(job.params["weight"], x["weight"], rtol=1e-6, atol=1e-7)
    assert job.round_log[0]["updates"] == 1 and job.round_log[0]["dropped"] == 1
    assert job.round_log[1]["updates"] == 2


def test_update_from_a_non_participant_or_twice_is_discarded():
    job = small_job(kappa=1)
    drv = Driver(job)
    (d,), _ = drv.open(["a", "b"])
    other = "b" if d == "a" else "a"
    rng = np.random.default_rng(10)
    h = head(rng)
    job.apply(other, job.parse_result(wire_result(other, h["weight"], h["bias"], 3)))
    job.apply(d, job.parse_result(wire_result(d, h["weight"], h["bias"], 3)))
    job.apply(d, job.parse_result(wire_result(d, h["weight"], h["bias"], 3)))
    assert job.late_discarded == 2 and job.contributions == 1


def test_fed3r_init_and_evaluation():
    rng = np.random.default_rng(11)
    Z = rng.normal(size=(200, D))
    y = rng.integers(0, C, 200)
    model = ClosedFormRidge(0.01, device="cpu").fit(Z, y, C)
    job = FedAvgJob.from_fed3r(FedAvgConfig(num_classes=C, feature_dim=D, client_lr=0.1), model)
    np.testing.assert_array_equal(job.params["weight"], model.coef_.astype(np.float32))
    np.testing.assert_array_equal(job.params["bias"], model.intercept_.astype(np.float32))
    assert job.config.device_lr == pytest.approx(0.01)
    acc = job.evaluate(Z, y)["accuracy"]
    assert acc == pytest.approx(float((model.predict(Z) == y).mean()))
    with pytest.raises(ValueError):
        FedAvgJob(FedAvgConfig(num_classes=C, feature_dim=D, init="fed3r"))
    with pytest.raises(ValueError):
        FedAvgJob.from_fed3r(FedAvgConfig(num_classes=C + 1, feature_dim=D), model)


def test_fed3r_init_scale_widens_the_margins_and_keeps_the_predictions():
    """init_scale α: the starting head is α × Fed3R's (float32 of the product), so every logit and
    every margin is α times Fed3R's and the predictions are Fed3R's; a bad α is refused."""
    rng = np.random.default_rng(12)
    Z = rng.normal(size=(200, D))
    y = rng.integers(0, C, 200)
    model = ClosedFormRidge(0.01, device="cpu").fit(Z, y, C)
    job = FedAvgJob.from_fed3r(FedAvgConfig(num_classes=C, feature_dim=D, init_scale=10.0), model)
    np.testing.assert_array_equal(job.params["weight"], (model.coef_ * 10.0).astype(np.float32))
    np.testing.assert_array_equal(job.params["bias"], (model.intercept_ * 10.0).astype(np.float32))
    assert (job.evaluate(Z, y)["accuracy"]) == pytest.approx(float((model.predict(Z) == y).mean()))
    plain = FedAvgJob.from_fed3r(FedAvgConfig(num_classes=C, feature_dim=D), model)
    np.testing.assert_array_equal(plain.params["weight"], model.coef_.astype(np.float32))   # α = 1: Fed3R's bits
    random_init = FedAvgJob(FedAvgConfig(num_classes=C, feature_dim=D, init="random", init_scale=10.0, seed=3))
    np.testing.assert_array_equal(random_init.params["weight"],
                                  FedAvgJob(FedAvgConfig(num_classes=C, feature_dim=D, seed=3)).params["weight"])
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e4, True, "10"):
        with pytest.raises(ValueError, match="init_scale"):
            FedAvgConfig(num_classes=C, feature_dim=D, init_scale=bad)


def test_job_state_round_trips():
    # a round of one update before any reference moves nothing (SmallRoundReference): this one must move
    job = small_job(server_momentum=0.9, kappa=1, small_round_reference=False)
    drv = Driver(job)
    rng = np.random.default_rng(12)
    (d,), _ = drv.open(["a"])
    h = head(rng)
    drv.deliver(d, wire_result(d, h["weight"], h["bias"], 4))
    clone = small_job(server_momentum=0.9, kappa=1, small_round_reference=False)
    clone.load_state_dict(job.state_dict())
    assert clone.round == 1
    np.testing.assert_array_equal(clone.params["weight"], job.params["weight"])
    np.testing.assert_array_equal(clone.strategy.velocity["bias"], job.strategy.velocity["bias"])


def test_evaluation_helpers_against_plain_sums():
    rng = np.random.default_rng(13)
    W, b = rng.normal(size=(C, D)), rng.normal(size=C)
    Z, y = rng.normal(size=(50, D)), rng.integers(0, C, 50)
    manual = sum(int(np.argmax([Z[i] @ W[c] + b[c] for c in range(C)]) == y[i]) for i in range(50)) / 50
    assert head_accuracy(W, b, Z, y) == pytest.approx(manual)
    correct, totals = np.array([3, 0, 9]), np.array([4, 0, 10])
    assert weighted_mean_accuracy(correct, totals) == pytest.approx((0.75 * 4 + 0.9 * 10) / 14)
    with pytest.raises(ValueError):
        weighted_mean_accuracy([5], [4])
    with pytest.raises(ValueError):
        weighted_mean_accuracy([0], [0])
    with pytest.raises(ValueError):
        head_accuracy(W, b, Z[:, :3], y)


def test_fedavg_starts_from_a_fed3r_model_file(tmp_path):
    """Fed3R+FT from the command line: a Fed3R job's model.npz initialises the head, LR x 0.1."""
    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
    from edge_client.fed3r import Fed3RAccumulator
    from protocols.payloads.fed3r import parse_stats, encode_stats
    from protocols.envelope import Envelope

    rng = np.random.default_rng(0)
    fed3r = Fed3RJob(Fed3RConfig(num_classes=3, feature_dim=4))
    acc = Fed3RAccumulator(3, 4)
    acc.update(rng.normal(size=(50, 4)), rng.integers(0, 3, 50))
    A, ids, b = acc.sparse()
    body, t = encode_stats(A, ids, b, acc.n, 3)
    fed3r.apply("d", parse_stats(Envelope("result", "d", body, t), 5, 3))
    np.savez(tmp_path / "model.npz", **fed3r.model_arrays())
    job = FedAvgJob(FedAvgConfig(num_classes=3, feature_dim=4, init="fed3r", client_lr=0.1,
                                 initial_head_file=str(tmp_path / "model.npz")))
    ridge = fed3r.model()
    np.testing.assert_allclose(job.params["weight"], ridge.coef_, rtol=1e-6)
    np.testing.assert_allclose(job.params["bias"], ridge.intercept_, rtol=1e-6)
    assert job.task_for("d")[0]["lr"] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="initial_head_file"):
        FedAvgJob(FedAvgConfig(num_classes=3, feature_dim=4, init="fed3r"))
