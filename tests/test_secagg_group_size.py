"""The protocol's largest group (``MAX_GROUP_SIZE``): a round config naming more members is refused,
and a secure job that would draw more is refused when it is built, so no aggregator sends one
(the devices refuse it at once: tests/test_java_secagg.py holds Python's and Java's reason equal)."""

from __future__ import annotations

import pytest

from aggregator.jobs.fed3r_sync import Fed3RSyncConfig
from aggregator.jobs.secure_fedavg import SecureFedAvgConfig
from protocols.secagg import RoundConfig
from protocols.secagg.config import MAX_GROUP_SIZE
from protocols.secagg.errors import ConfigError


def _config(n: int) -> RoundConfig:
    return RoundConfig.create(job_id="j", round_id=1, group_id="g", aggregator_id="aggregator",
                              members=[f"d{i:05d}" for i in range(n)], vector_length=4, bound=1.0)


def test_a_round_config_beyond_the_largest_group_is_refused():
    assert len(_config(MAX_GROUP_SIZE).members) == MAX_GROUP_SIZE
    with pytest.raises(ConfigError, match=f"a group has at most {MAX_GROUP_SIZE} members, got {MAX_GROUP_SIZE + 1}"):
        _config(MAX_GROUP_SIZE + 1)


@pytest.mark.parametrize("config_cls", [Fed3RSyncConfig, SecureFedAvgConfig])
def test_a_secure_job_drawing_more_than_the_largest_group_is_refused_when_built(config_cls):
    config_cls(clients_per_round=MAX_GROUP_SIZE)
    with pytest.raises(ValueError, match=f"at most {MAX_GROUP_SIZE}"):
        config_cls(clients_per_round=MAX_GROUP_SIZE + 1)
