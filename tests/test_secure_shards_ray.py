"""Secure jobs with their shards as Ray actors on the shared two-node test cluster (one per node,
tests/ray_cluster.py): one aggregator's model bytes, as on local shards
(tests/test_secure_shards_parity.py). The suite runs Fed3R-Sync; ``make test-ray``
(FEDFLEET_RAY_ALL=1) every secure kind shards host."""

import pytest

from shard_runs import RAY_ALL, needs_ray
from secure_shard_runs import (DEVICES, SECURE_ROUND_KINDS, SHARDS, SYNC_KINDS, assert_same_bytes,
                               check_secure_rounds, one_and_sharded)


# `make test-ray` (shard_runs.RAY_ALL) runs every secure kind shards host on Ray actors: the same
# placement and group paths as Fed3R-Sync's
RAY_KINDS = [*SYNC_KINDS, *SECURE_ROUND_KINDS] if RAY_ALL else ["fed3r-sync"]


@pytest.mark.slow
@pytest.mark.ray_cluster
@needs_ray
@pytest.mark.parametrize("kind", RAY_KINDS)
def test_secure_kinds_on_ray_actor_shards_give_one_aggregators_model_bit_for_bit(tmp_path, ray_test_cluster, kind,
                                                                                 request):
    """The shards as Ray actors on the two-node test cluster, one per node: the same bytes."""
    sharded = [*SHARDS, "--ray", ray_test_cluster]
    if kind not in SYNC_KINDS:
        return check_secure_rounds(tmp_path, kind, request, sharded)
    (want, _), (got, results) = one_and_sharded(tmp_path, kind, sharded=sharded)
    assert_same_bytes(got, want)
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
