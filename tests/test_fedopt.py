"""FedAdam / FedYogi / FedAdagrad (aggregator/strategies/fedopt.py) against a plain scalar loop of
Reddi et al. 2021's Algorithm 2, their checkpoint, their refusals, and a job selecting them."""

import math

import numpy as np
import pytest

from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.jobs.registry import build_job, validate_job_config
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.strategies.fedavg import FedAvg, ServerOptimizer
from aggregator.strategies.fedopt import FedAdagrad, FedAdam, FedYogi, make_server_optimizer

C, D = 3, 4


def reference_fedopt(variant: str, x0: list[float], means: list[list[float]], lr, b1, b2, tau) -> list[list[float]]:
    """Algorithm 2 one coordinate at a time with Python floats: the iterates x_1 .. x_T."""
    x, m, v = list(x0), [0.0] * len(x0), [tau * tau] * len(x0)
    out = []
    for mean in means:
        for i in range(len(x)):
            d = mean[i] - x[i]
            m[i] = b1 * m[i] + (1 - b1) * d
            if variant == "adagrad":
                v[i] = v[i] + d * d
            elif variant == "adam":
                v[i] = b2 * v[i] + (1 - b2) * d * d
            else:
                s = v[i] - d * d
                v[i] = v[i] - (1 - b2) * d * d * (1.0 if s > 0 else -1.0 if s < 0 else 0.0)
            x[i] = x[i] + lr * m[i] / (math.sqrt(v[i]) + tau)
        out.append(list(x))
    return out


CLASSES = {"adam": FedAdam, "yogi": FedYogi, "adagrad": FedAdagrad}


@pytest.mark.parametrize("variant", sorted(CLASSES))
def test_fedopt_equals_the_plain_loop_over_several_rounds(variant):
    rng = np.random.default_rng(7)
    x = {"weight": rng.normal(size=(C, D)), "bias": rng.normal(size=C)}
    # the round means: around the moving iterate, with one coordinate jumping (exercises Yogi's sign)
    means = [{k: v + rng.normal(scale=0.3 * (t + 1), size=v.shape) for k, v in x.items()} for t in range(5)]
    opt = CLASSES[variant](server_lr=0.05, beta1=0.8, beta2=0.95, tau=1e-2)
    params = {k: v.copy() for k, v in x.items()}
    iterates = []
    for mean in means:
        params = opt.step(params, mean)
        iterates.append(params)
    for name in x:
        flat_means = [m[name].ravel().tolist() for m in means]
        ref = reference_fedopt(variant, x[name].ravel().tolist(), flat_means, 0.05, 0.8, 0.95, 1e-2)
        for got, want in zip(iterates, ref):
            np.testing.assert_allclose(got[name].ravel(), want, rtol=1e-12, atol=1e-14)
    assert opt.steps == 5


def test_variants_differ_and_keep_the_parameters_dtype():
    rng = np.random.default_rng(1)
    x = {"weight": rng.normal(size=(C, D)).astype(np.float32)}
    means = [{"weight": x["weight"] + rng.normal(size=(C, D)).astype(np.float32)} for _ in range(3)]
    finals = {}
    for name, cls in CLASSES.items():
        params, opt = x, cls(0.1)
        for mean in means:
            params = opt.step(params, mean)
        assert params["weight"].dtype == np.float32
        finals[name] = params["weight"]
    assert not np.allclose(finals["adam"], finals["yogi"]) and not np.allclose(finals["adam"], finals["adagrad"])


@pytest.mark.parametrize("variant", sorted(CLASSES))
def test_restored_moments_continue_bit_identically(variant):
    rng = np.random.default_rng(3)
    x = {"weight": rng.normal(size=(C, D)), "bias": rng.normal(size=C)}
    means = [{k: v + rng.normal(size=v.shape) for k, v in x.items()} for _ in range(4)]
    straight = CLASSES[variant](0.1)
    p = x
    for mean in means:
        p = straight.step(p, mean)
    first = CLASSES[variant](0.1)
    q = first.step(first.step(x, means[0]), means[1])
    state = {k: np.array(v) for k, v in first.state_dict().items()}
    resumed = CLASSES[variant](0.1)
    resumed.load_state_dict(state)
    for mean in means[2:]:
        q = resumed.step(q, mean)
    for k in p:
        np.testing.assert_array_equal(p[k], q[k])
    assert resumed.steps == 4


@pytest.mark.parametrize("kwargs", [{"server_lr": 0}, {"server_lr": float("nan")}, {"beta1": 1.0},
                                    {"beta2": -0.1}, {"tau": 0.0}])
def test_fedopt_rejects_bad_hyperparameters(kwargs):
    with pytest.raises(ValueError):
        FedAdam(**kwargs)


def test_factory_picks_by_name_and_refuses_momentum_on_adaptive():
    assert isinstance(make_server_optimizer("sgd", 1.0, 0.9), FedAvg)
    assert all(isinstance(make_server_optimizer(n, 0.1), ServerOptimizer) for n in CLASSES)
    with pytest.raises(ValueError, match="server_momentum"):
        make_server_optimizer("adam", 0.1, momentum=0.9)
    with pytest.raises(ValueError, match="server_optimizer"):
        make_server_optimizer("lamb", 0.1)


def test_job_config_selects_the_optimizer_and_refuses_bad_values():
    base = {"num_classes": C, "feature_dim": D, "rounds": 2, "clients_per_round": 2, **PLAIN_MEAN}
    job = build_job("fedavg", {**base, "server_optimizer": "yogi", "server_lr": 0.05, "server_beta2": 0.9})
    assert isinstance(job.strategy, FedYogi) and job.strategy.beta2 == 0.9 and job.strategy.server_lr == 0.05
    assert isinstance(build_job("fedavg", base).strategy, FedAvg)
    for bad in ({"server_optimizer": "lamb"}, {"server_tau": 0.0}, {"server_beta1": 1.5},
                {"server_optimizer": "adam", "server_momentum": 0.9}):
        with pytest.raises(ValueError):
            build_job("fedavg", {**base, **bad})
    validate_job_config("fedavg-secure", {"server_optimizer": "adagrad"})


def test_job_with_fedadam_checkpoints_its_moments():
    rng = np.random.default_rng(0)
    cfg = FedAvgConfig(num_classes=C, feature_dim=D, rounds=3, clients_per_round=1, server_optimizer="adam",
                       server_lr=0.1, **PLAIN_MEAN)
    job = FedAvgJob(cfg)
    start = {k: v.astype(np.float64) for k, v in job.params.items()}
    mean = {k: v + rng.normal(size=v.shape) for k, v in start.items()}
    job.params = {k: v.astype(np.float32) for k, v in job.strategy.step(job.params, mean).items()}
    state = job.state_dict()
    assert {"server_m.weight", "server_v.bias"} <= set(state)
    clone = FedAvgJob(cfg)
    clone.load_state_dict(state)
    a = job.strategy.step(job.params, mean)
    b = clone.strategy.step(clone.params, mean)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_simulate_flag_reaches_the_config_and_a_bad_choice_fails_before_the_run():
    import dataclasses

    from fedfleet.cli import build_parser, simulate_overrides
    from fedfleet.pipeline import ft_optimizer_fields, run_pipeline
    from fedfleet.sim_config import load_config

    args = build_parser().parse_args(["simulate", "--config", "smoke", "--pipeline", "fed3r-ft-oll",
                                      "--server-optimizer", "yogi", "--server-lr", "0.03", "--local-rule", "asam",
                                      "--sam-rho", "0.5", "--prox-mu", "0.01", "--served-model", "swa"])
    cfg = load_config(args.config, simulate_overrides(args))
    assert (cfg.ft_server_optimizer, cfg.ft_server_lr) == ("yogi", 0.03)
    assert (cfg.ft_local_rule, cfg.ft_sam_rho, cfg.ft_prox_mu, cfg.ft_served_model) == ("asam", 0.5, 0.01, "swa")
    job = FedAvgConfig(**ft_optimizer_fields(cfg))
    assert (job.local_rule, job.served_model, job.swa_start_round) == ("asam", "swa", 3)     # 0.75 of 5 rounds
    for bad, match in (({"ft_server_optimizer": "adam", "ft_server_momentum": 0.9}, "server_momentum"),
                       ({"ft_local_rule": "lion"}, "local_rule"), ({"ft_served_model": "ema"}, "served_model")):
        with pytest.raises(ValueError, match=match):      # refused before any data or fleet
            run_pipeline(dataclasses.replace(cfg, **bad), quiet=True)
