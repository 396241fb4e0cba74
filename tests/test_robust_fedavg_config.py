"""Robust FedAvg's conditions checked when a job is created: a rule whose condition fails is refused,
and under secure aggregation the plaintext layers are off and refused while the round history,
which needs only the round's sum, may be on."""

import pytest

from aggregator.jobs.fedavg import FedAvgConfig
from aggregator.jobs.registry import build_job


@pytest.mark.parametrize("bad", [{"aggregator": "krum", "krum_byzantine": 3},          # 7 < 2·3 + 3
                                 {"aggregator": "multi_krum", "clients_per_round": 4},
                                 {"aggregator": "nope"}, {"norm_bound_multiplier": 0.5},
                                 {"contribution_bound_multiplier": -1.0}, {"history_momentum": 1.0},
                                 {"history_momentum": -0.1}, {"direction_screen": "yes"},
                                 {"small_round_reference": "yes"},
                                 {"aggregator": "median", "dp_noise_multiplier": 1.0}])
def test_a_rule_whose_condition_fails_is_refused_when_the_job_is_created(bad):
    with pytest.raises(ValueError):
        build_job("fedavg", {"num_classes": 2, "feature_dim": 3, "clients_per_round": 7, **bad})
    assert FedAvgConfig(clients_per_round=5, aggregator="krum", krum_byzantine=1).aggregator == "krum"


@pytest.mark.parametrize("layer", [{"contribution_bound_multiplier": 0.5}, {"direction_screen": True}])
def test_the_plaintext_layers_are_off_and_refused_under_secure_aggregation(layer):
    from aggregator.jobs.secure_fedavg import SecureFedAvgConfig

    config = SecureFedAvgConfig()
    assert not (config.contribution_bound_multiplier or config.direction_screen or config.history_momentum)
    with pytest.raises(ValueError, match="plaintext"):
        SecureFedAvgConfig(**layer)


def test_a_secure_job_may_step_along_the_round_history_which_needs_only_the_rounds_sum():
    from aggregator.jobs.secure_fedavg import SecureFedAvgConfig

    assert SecureFedAvgConfig(history_momentum=0.7).round_history().momentum == 0.7
    with pytest.raises(ValueError, match="momentum"):
        SecureFedAvgConfig(history_momentum=1.0)
