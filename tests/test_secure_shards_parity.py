"""Secure jobs on two shards (aggregator/shards/secure_groups.py) over a real mosquitto with real
device agents and real SecAgg: each round's group runs its server machine on the shard
``round % 2``, the coordinator applies the unmasked group sums. The model must be the bytes of one
aggregator's run of the same job (same groups, same integers), for Fed3R-Sync, FedNCM-Sync and
each kind of the secure FedAvg family, the stateful kinds' devices keeping the same state, and the
coordinator must never see a masked vector. The runs: tests/secure_shard_runs.py; on Ray actors:
tests/test_secure_shards_ray.py."""

import numpy as np
import pytest

from aggregator.shards.buckets import shard_of

from ops_fleet import reference_sums
from secure_shard_runs import (DEVICES, SECURE_ROUND_KINDS, SYNC_KINDS, assert_same_bytes, check_secure_rounds,
                               one_and_sharded)


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_secure_fed3r_sync_on_two_shards_gives_one_aggregators_model_bit_for_bit(tmp_path, kind):
    """Two groups of three: round 1's hosted by shard 1, whose bucket holds one device of the six
    (the others' messages reach it by the group's subscriptions), round 2's by shard 0. FedNCM-Sync
    runs the same groups, solved as class means: the same placement, the same bytes."""
    assert {shard_of(d, 2) for d in DEVICES} == {0, 1}
    (want, _), (got, results) = one_and_sharded(tmp_path, kind)
    assert_same_bytes(got, want)
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
    stats = got[1]
    A_ref, B_ref = reference_sums(DEVICES, dtype=np.float32)                      # and right
    np.testing.assert_allclose(stats["A"], A_ref, rtol=1e-10, atol=1e-8)
    np.testing.assert_allclose(stats["B"], B_ref, rtol=1e-10, atol=1e-8)


@pytest.mark.parametrize("kind", SECURE_ROUND_KINDS)
def test_secure_fedavg_kinds_on_two_shards_give_one_aggregators_model_bit_for_bit(tmp_path, kind, request):
    check_secure_rounds(tmp_path, kind, request)
