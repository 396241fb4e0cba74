"""Partial sums whose arrays differ in shape are refused, not broadcast: numpy adds a (1, d) to a
(c, d) without a word, so a shard of another job or version (a b of another class count) would
have been folded into the root by broadcasting. The root of well-shaped sums is their plain sum."""

import numpy as np
import pytest

from aggregator.shards.fed3r_sums import Fed3RSums
from aggregator.shards.sum_tree import NUM_BUCKETS, PartialSum, root_sum


def state(rows: int, rng) -> dict[str, np.ndarray]:
    return {"A": rng.normal(size=(6,)), "b": rng.normal(size=(rows, 3)), "n": np.array([2.0])}


def halves(left: dict, right: dict) -> dict:
    mid = NUM_BUCKETS // 2
    return {(0, mid): PartialSum(left, {"dev0": 1}), (mid, NUM_BUCKETS): PartialSum(right, {"dev1": 1})}


def test_well_shaped_partial_sums_add_to_their_plain_sum():
    rng = np.random.default_rng(0)
    left, right = state(4, rng), state(4, rng)
    root = root_sum(Fed3RSums(), halves(left, right))
    for name in left:
        np.testing.assert_array_equal(root.state[name], left[name] + right[name])


def test_partial_sums_of_other_shapes_are_refused_naming_the_array():
    rng = np.random.default_rng(1)
    left, right = state(4, rng), state(1, rng)       # broadcastable: numpy alone would sum them
    with pytest.raises(ValueError, match=r"shapes differ: b \[4, 3\] and \[1, 3\]"):
        root_sum(Fed3RSums(), halves(left, right))
