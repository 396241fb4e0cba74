"""Seeded data partitions and device profiles of the emulated fleet.

Invariants are checked with plain numpy/set arithmetic (cover, disjointness, class
counts); skew is checked by ordering, not by hard-coded values.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfleet.emulation import (
    DeviceProfile,
    make_split,
    mean_label_jaccard,
    sample_profiles,
    split_dirichlet,
    split_iid,
    split_k_classes,
    train_holdout_split,
)


def imbalanced_labels(n=4000, n_classes=10, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.5, 2.0, n_classes)
    return rng.choice(n_classes, size=n, p=weights / weights.sum())


LABELS = imbalanced_labels()


def assert_partition(parts, n_samples, exact_cover: bool):
    """No index twice, all in range, arrays sorted int64, no empty device, optionally full cover."""
    assert all(p.dtype == np.int64 and p.ndim == 1 and len(p) > 0 for p in parts)
    assert all(np.all(np.diff(p) > 0) for p in parts)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined), "an index is on two devices"
    assert joined.min() >= 0 and joined.max() < n_samples
    if exact_cover:
        assert len(joined) == n_samples


def same_split(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def classes_per_device(labels, parts) -> list[int]:
    return [len(set(labels[p].tolist())) for p in parts]


# ---------------------------------------------------------------- iid

def test_iid_covers_every_sample_once_in_near_equal_parts():
    parts = split_iid(1003, 10, seed=3)
    assert_partition(parts, 1003, exact_cover=True)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_iid_is_seeded():
    assert same_split(split_iid(500, 7, 1), split_iid(500, 7, 1))
    assert not same_split(split_iid(500, 7, 1), split_iid(500, 7, 2))


def test_iid_refuses_empty_devices():
    with pytest.raises(ValueError, match="at least one"):
        split_iid(3, 4, seed=0)
    assert_partition(split_iid(4, 4, seed=0), 4, exact_cover=True)


# ---------------------------------------------------------------- dirichlet

def test_dirichlet_assigns_every_sample_at_most_once():
    for alpha in [0.05, 0.5, 10.0]:
        parts = split_dirichlet(LABELS, 20, alpha, seed=5)
        assert_partition(parts, len(LABELS), exact_cover=True)


def test_dirichlet_is_seeded():
    assert same_split(split_dirichlet(LABELS, 12, 0.3, 9), split_dirichlet(LABELS, 12, 0.3, 9))
    assert not same_split(split_dirichlet(LABELS, 12, 0.3, 9), split_dirichlet(LABELS, 12, 0.3, 10))


def test_dirichlet_small_alpha_is_more_skewed():
    jaccard, n_classes = {}, {}
    for alpha in [0.05, 0.5, 100.0]:
        runs = [split_dirichlet(LABELS, 20, alpha, seed) for seed in range(3)]
        jaccard[alpha] = np.mean([mean_label_jaccard(LABELS, parts) for parts in runs])
        n_classes[alpha] = np.mean([classes_per_device(LABELS, parts) for parts in runs])
    assert jaccard[0.05] < jaccard[0.5] < jaccard[100.0]
    assert n_classes[0.05] < n_classes[0.5] < n_classes[100.0]
    assert n_classes[100.0] == 10  # near-IID: every device sees every class


def test_dirichlet_large_alpha_gives_each_device_about_1_over_k_of_each_class():
    parts = split_dirichlet(LABELS, 8, 1e4, seed=0)
    counts = np.stack([np.bincount(LABELS[p], minlength=10) for p in parts])
    expected = np.bincount(LABELS, minlength=10) / 8
    assert np.abs(counts - expected).max() <= 0.1 * expected.max()


@pytest.mark.parametrize("min_size", [1, 7])
def test_dirichlet_min_size_holds_even_for_tiny_alpha(min_size):
    # alpha = 1e-3 puts each class on about one device, so redraws cannot help and
    # the rebalancing path must fill the other devices.
    parts = split_dirichlet(LABELS, 60, 1e-3, seed=1, min_size=min_size)
    assert_partition(parts, len(LABELS), exact_cover=True)
    assert min(len(p) for p in parts) >= min_size


def test_dirichlet_min_size_infeasible():
    with pytest.raises(ValueError, match="min_size"):
        split_dirichlet(LABELS[:50], 10, 1.0, seed=0, min_size=6)


@pytest.mark.parametrize("alpha", [0, -1.0, float("nan"), float("inf")])
def test_dirichlet_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        split_dirichlet(LABELS, 5, alpha, seed=0)


# ---------------------------------------------------------------- k classes

@pytest.mark.parametrize("n_devices, k", [(10, 1), (25, 1), (20, 2), (7, 3), (30, 10), (3, 4)])
def test_k_classes_exactly_k_per_device_and_full_cover(n_devices, k):
    parts = split_k_classes(LABELS, n_devices, k, seed=4)
    assert_partition(parts, len(LABELS), exact_cover=True)
    assert classes_per_device(LABELS, parts) == [k] * n_devices
    # Each class is spread over floor or ceil of n_devices*k/n_classes devices.
    holders = np.zeros(10, int)
    for p in parts:
        holders[np.unique(LABELS[p])] += 1
    assert set(holders.tolist()) <= {n_devices * k // 10, math.ceil(n_devices * k / 10)}


def test_k_classes_one_class_per_device_when_devices_equal_classes():
    parts = split_k_classes(LABELS, 10, 1, seed=0)
    assert sorted(LABELS[p[0]] for p in parts) == list(range(10))
    for p in parts:
        assert np.all(LABELS[p] == LABELS[p[0]])
        assert len(p) == np.sum(LABELS == LABELS[p[0]])  # the whole class, nowhere else


def test_k_classes_is_seeded():
    assert same_split(split_k_classes(LABELS, 15, 2, 1), split_k_classes(LABELS, 15, 2, 1))
    assert not same_split(split_k_classes(LABELS, 15, 2, 1), split_k_classes(LABELS, 15, 2, 2))


@pytest.mark.parametrize(
    "n_devices, k, message",
    [(10, 0, "k must"), (10, 11, "exceeds"), (4, 2, "cannot cover"), (0, 1, "n_devices")],
)
def test_k_classes_bad_params(n_devices, k, message):
    with pytest.raises(ValueError, match=message):
        split_k_classes(LABELS, n_devices, k, seed=0)


def test_k_classes_class_too_small_to_spread():
    labels = np.array([0] * 50 + [1] * 2)
    with pytest.raises(ValueError, match="class 1 has 2 samples"):
        split_k_classes(labels, 8, 1, seed=0)


@settings(max_examples=60, deadline=None)
@given(
    n_classes=st.integers(1, 8),
    n_devices=st.integers(1, 25),
    k=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
)
def test_k_classes_property(n_classes, n_devices, k, seed):
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(n_classes) * 3, 40))
    if k > n_classes or n_devices * k < n_classes:
        with pytest.raises(ValueError):
            split_k_classes(labels, n_devices, k, seed)
        return
    parts = split_k_classes(labels, n_devices, k, seed)
    assert_partition(parts, len(labels), exact_cover=True)
    assert classes_per_device(labels, parts) == [k] * n_devices


@settings(max_examples=60, deadline=None)
@given(
    n_devices=st.integers(1, 30),
    alpha=st.floats(1e-3, 1e3),
    min_size=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_dirichlet_property(n_devices, alpha, min_size, seed):
    labels = imbalanced_labels(n=150, n_classes=6, seed=seed % 100)
    if len(labels) < n_devices * min_size:
        return
    parts = split_dirichlet(labels, n_devices, alpha, seed, min_size=min_size)
    assert_partition(parts, len(labels), exact_cover=True)
    assert min(len(p) for p in parts) >= min_size


# ---------------------------------------------------------------- make_split / labels

def test_make_split_dispatches():
    assert same_split(make_split("iid", LABELS, 6, 2), split_iid(len(LABELS), 6, 2))
    assert same_split(make_split("dirichlet", LABELS, 6, 2, alpha=0.4, min_size=3),
                      split_dirichlet(LABELS, 6, 0.4, 2, min_size=3))
    assert same_split(make_split("classes", LABELS, 6, 2, k=3), split_k_classes(LABELS, 6, 3, 2))


@pytest.mark.parametrize(
    "kind, params, message",
    [
        ("shards", {}, "unknown split kind"),
        ("iid", {"alpha": 1.0}, "unknown"),
        ("dirichlet", {}, "missing \\['alpha'\\]"),
        ("dirichlet", {"alpha": 1.0, "k": 2}, "unknown \\['k'\\]"),
        ("classes", {}, "missing \\['k'\\]"),
        ("dirichlet", {"alpha": -0.5}, "alpha"),
        ("classes", {"k": 0}, "k must"),
    ],
)
def test_make_split_bad_kind_or_params(kind, params, message):
    with pytest.raises(ValueError, match=message):
        make_split(kind, LABELS, 5, 0, **params)


@pytest.mark.parametrize("kind, params", [("iid", {}), ("dirichlet", {"alpha": 1.0}), ("classes", {"k": 2})])
@pytest.mark.parametrize(
    "labels, n_devices",
    [(LABELS.astype(float), 5), (LABELS.reshape(-1, 2), 5), (np.array([], dtype=int), 5), (LABELS, 0), (LABELS, 2.5)],
    ids=["float labels", "2-D labels", "empty labels", "zero devices", "float devices"],
)
def test_bad_labels_or_device_count(kind, params, labels, n_devices):
    with pytest.raises(ValueError):
        make_split(kind, labels, n_devices, 0, **params)


def test_mean_label_jaccard_matches_set_arithmetic():
    parts = split_dirichlet(LABELS, 9, 0.2, seed=2)
    sets = [set(LABELS[p].tolist()) for p in parts]
    reference = np.mean([[len(a & b) / len(a | b) for b in sets] for a in sets])
    assert mean_label_jaccard(LABELS, parts) == pytest.approx(reference)


# ---------------------------------------------------------------- train / holdout

def test_train_holdout_split_partitions_a_device():
    indices = split_iid(1000, 4, seed=0)[1]
    train, holdout = train_holdout_split(indices, 0.2, seed=3)
    assert len(holdout) == round(0.2 * len(indices))
    assert np.intersect1d(train, holdout).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([train, holdout])), indices)
    again = train_holdout_split(indices, 0.2, seed=3)
    assert np.array_equal(again[1], holdout)
    assert not np.array_equal(train_holdout_split(indices, 0.2, seed=4)[1], holdout)


def test_train_holdout_small_devices_keep_both_sides():
    train, holdout = train_holdout_split(np.array([5, 9]), 0.1, seed=0)
    assert len(train) == 1 and len(holdout) == 1
    train, holdout = train_holdout_split(np.array([5, 9, 11]), 0.0, seed=0)
    assert len(holdout) == 0 and len(train) == 3


@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.99])
def test_train_holdout_a_single_sample_stays_for_training(fraction):
    train, holdout = train_holdout_split(np.array([7]), fraction, seed=0)
    assert train.tolist() == [7] and holdout.tolist() == []


@pytest.mark.parametrize("n", range(0, 12))
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 0.99])
def test_train_holdout_size_follows_its_rule(n, fraction):
    """round(f * n), at least 1 when f > 0 and n >= 2, at most n - 1 (never below 0)."""
    expected = round(fraction * n)
    if fraction > 0 and n >= 2:
        expected = max(expected, 1)
    expected = max(min(expected, n - 1), 0)
    train, holdout = train_holdout_split(np.arange(n), fraction, seed=n)
    assert len(holdout) == expected and len(train) == n - expected
    assert sorted([*train.tolist(), *holdout.tolist()]) == list(range(n))


@pytest.mark.parametrize("fraction", [1.0, -0.1, float("nan")])
def test_train_holdout_bad_fraction(fraction):
    with pytest.raises(ValueError, match="holdout_fraction"):
        train_holdout_split(np.arange(10), fraction, seed=0)


def test_train_holdout_bad_indices():
    with pytest.raises(ValueError, match="duplicates"):
        train_holdout_split(np.array([1, 2, 2]), 0.5, seed=0)
    with pytest.raises(ValueError, match="1-D integer"):
        train_holdout_split(np.array([1.0, 2.0]), 0.5, seed=0)


# ---------------------------------------------------------------- device profiles

def test_profiles_are_seeded_and_named():
    a = sample_profiles(50, seed=1)
    assert a == sample_profiles(50, seed=1)
    assert a != sample_profiles(50, seed=2)
    assert [p.device_id for p in a[:2]] == ["dev0000", "dev0001"]
    assert sample_profiles(3, 0, id_prefix="cam")[2].device_id == "cam0002"


def test_profiles_are_log_uniform_within_bounds():
    profiles = sample_profiles(4000, seed=0, slowdown=(1.0, 4.0), bandwidth_bps=(2e6, 50e6))
    slowdowns = np.array([p.compute_slowdown for p in profiles])
    rates = np.array([p.upload_bytes_per_s for p in profiles])
    assert slowdowns.min() >= 1.0 and slowdowns.max() <= 4.0
    assert rates.min() >= 2e6 / 8 and rates.max() <= 50e6 / 8  # bits/s in, bytes/s stored
    # Log-uniform: log values are uniform, so the median is the geometric mean of the bounds
    # (2.0 here; a plain uniform draw would give 2.5).
    assert np.median(slowdowns) == pytest.approx(2.0, abs=0.1)
    assert np.median(rates) == pytest.approx(math.sqrt(2e6 * 50e6) / 8, rel=0.1)


def test_profiles_availability_windows():
    profiles = sample_profiles(200, seed=0, availability_fraction=0.25, horizon_s=400.0)
    for p in profiles:
        (start, end), = p.availability
        assert 0 <= start and end <= 400.0 and end - start == pytest.approx(100.0)
        assert p.is_available(start) and not p.is_available(end)
    assert all(p.availability == () for p in sample_profiles(5, seed=0))


def test_profile_time_arithmetic():
    p = DeviceProfile("d", compute_slowdown=3.0, upload_bytes_per_s=1000.0, dropout_prob=0.3,
                      availability=[(10, 20), (30.0, 40.0)])
    assert p.upload_delay(2500) == pytest.approx(2.5)
    assert p.extra_compute_delay(0.5) == pytest.approx(1.0)  # total 1.5 s = 3 x 0.5 s
    assert [p.is_available(t) for t in (0, 10, 19.99, 20, 35, 40)] == [False, True, True, False, True, False]
    assert [p.next_online_time(t) for t in (0, 15, 25, 45)] == [10.0, 15.0, 30.0, None]
    unlimited = DeviceProfile("u")
    assert unlimited.upload_delay(10**9) == 0.0 and unlimited.is_available(1e9)
    rng = np.random.default_rng(0)
    drops = np.mean([p.draws_dropout(rng) for _ in range(20000)])
    assert drops == pytest.approx(0.3, abs=0.02)


def test_profile_json_round_trip():
    profiles = sample_profiles(5, seed=3, availability_fraction=0.5, dropout_prob=(0.0, 0.2))
    text = json.dumps([p.to_dict() for p in profiles])
    assert [DeviceProfile.from_dict(d) for d in json.loads(text)] == profiles
    assert DeviceProfile.from_dict(DeviceProfile("x").to_dict()) == DeviceProfile("x")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"device_id": ""}, "device_id"),
        ({"compute_slowdown": 0.5}, "compute_slowdown"),
        ({"compute_slowdown": float("nan")}, "compute_slowdown"),
        ({"upload_bytes_per_s": 0.0}, "upload_bytes_per_s"),
        ({"upload_bytes_per_s": float("inf")}, "upload_bytes_per_s"),
        ({"dropout_prob": 1.5}, "dropout_prob"),
        ({"availability": [(5.0, 5.0)]}, "start < end"),
        ({"availability": [(0.0, 10.0), (5.0, 20.0)]}, "disjoint"),
        ({"availability": [(0.0, float("nan"))]}, "finite"),
    ],
)
def test_profile_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        DeviceProfile(**{"device_id": "d", **fields})


def test_profile_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown device profile keys"):
        DeviceProfile.from_dict({"device_id": "d", "speed": 2})
    with pytest.raises(ValueError, match="device_id"):
        DeviceProfile.from_dict({"compute_slowdown": 2})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_devices": 0}, "n_devices"),
        ({"slowdown": (0.5, 2.0)}, "slowdown"),
        ({"slowdown": (3.0, 2.0)}, "slowdown"),
        ({"bandwidth_bps": (0, 1e6)}, "bandwidth_bps"),
        ({"dropout_prob": 1.2}, "dropout_prob"),
        ({"dropout_prob": (0.1, 1.2)}, "dropout_prob"),
        ({"availability_fraction": 0.0}, "availability_fraction"),
        ({"horizon_s": -1.0}, "horizon_s"),
    ],
)
def test_sample_profiles_bad_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample_profiles(**{"n_devices": 4, "seed": 0, **kwargs})


def test_sample_profiles_unlimited_bandwidth():
    assert all(p.upload_bytes_per_s is None for p in sample_profiles(3, 0, bandwidth_bps=None))


# ----------------------------------------------------------------------------- long-tailed (cross-device)
def test_long_tailed_sizes_have_the_asked_mean_and_a_long_tail():
    labels = np.repeat(np.arange(10), 6000)
    parts = make_split("long-tailed", labels, 20_000, seed=3, alpha=0.1)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 1 and sizes.max() <= 50
    assert 4.0 <= sizes.mean() <= 6.0                       # ~5 on average, as asked
    assert np.median(sizes) < sizes.mean() and (sizes >= 20).sum() > 100    # skewed: a few hold dozens
    assert sum(sizes) > len(labels)                         # more device samples than the data: repeats
    assert all(len(np.unique(p)) == len(p) for p in parts)  # never twice on one device


def test_long_tailed_devices_are_label_skewed_and_seeded():
    labels = np.repeat(np.arange(10), 600)
    skewed = make_split("long-tailed", labels, 500, seed=1, alpha=0.1, mean_size=20, max_size=50)
    mixed = make_split("long-tailed", labels, 500, seed=1, alpha=100.0, mean_size=20, max_size=50)
    classes_per_device = lambda parts: np.mean([len(np.unique(labels[p])) for p in parts])  # noqa: E731
    assert classes_per_device(skewed) < 4 < 6 < classes_per_device(mixed)
    again = make_split("long-tailed", labels, 500, seed=1, alpha=0.1, mean_size=20, max_size=50)
    assert all(np.array_equal(a, b) for a, b in zip(skewed, again))


@pytest.mark.parametrize("params", [{"alpha": 0.0}, {"alpha": 0.1, "mean_size": 0.5}, {"alpha": 0.1, "max_size": 2.5},
                                    {"alpha": 0.1, "mean_size": 60, "max_size": 50}])
def test_long_tailed_refuses_bad_parameters(params):
    with pytest.raises(ValueError):
        make_split("long-tailed", np.arange(100) % 10, 10, seed=0, **params)
