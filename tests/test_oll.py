"""OLL: pruning to local labels, the deterministic label map, local-only prediction, FP(ψ)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from edge_client.oll import (LabelMap, OutOfLocalLabels, PersonalizedHead, fp_recipe, oll_learning_rate,
                             prune)
from edge_client.tasks.head_training import LocalTraining, train_head

C, D = 9, 5


@settings(max_examples=50, deadline=None)
@given(labels=st.lists(st.integers(0, C - 1), min_size=1, max_size=40), seed=st.integers(0, 2**31 - 1))
def test_prune_and_label_map_round_trip(labels, seed):
    rng = np.random.default_rng(seed)
    W, b = rng.normal(size=(C, D)).astype(np.float32), rng.normal(size=C).astype(np.float32)
    w_loc, b_loc, lm = prune(W, b, np.array(labels))
    present = sorted(set(labels))
    assert lm.global_ids.tolist() == present and lm.k == len(present)
    # Every kept row is the global row of the label it stands for (weights and bias).
    for i, g in enumerate(present):
        np.testing.assert_array_equal(w_loc[i], W[g])
        assert b_loc[i] == b[g]
    # global -> local -> global is the identity on local labels; local -> global -> local too.
    arr = np.array(labels)
    np.testing.assert_array_equal(lm.to_global(lm.to_local(arr)), arr)
    np.testing.assert_array_equal(lm.to_local(lm.to_global(np.arange(lm.k))), np.arange(lm.k))
    # Deterministic: order and repetition of the local labels do not change the map.
    assert LabelMap(rng.permutation(arr)).global_ids.tolist() == present


def test_unknown_labels_are_a_clear_error():
    lm = LabelMap(np.array([7, 2, 2]))
    with pytest.raises(OutOfLocalLabels, match=r"\[3, 5\]"):
        lm.to_local(np.array([2, 3, 5, 3]))
    with pytest.raises(ValueError):
        lm.to_global(np.array([2]))
    for bad in (np.array([], dtype=np.int64), np.array([0.5]), np.array([-1]), np.array([[1]])):
        with pytest.raises(ValueError):
            LabelMap(bad)
    with pytest.raises(ValueError):
        LabelMap(np.array([C]), num_classes=C)
    with pytest.raises(ValueError):
        prune(np.zeros((C, D)), np.zeros(C + 1), np.array([1]))


def test_prediction_is_softmax_over_local_labels_only():
    rng = np.random.default_rng(0)
    W, b = rng.normal(size=(C, D)).astype(np.float32), rng.normal(size=C).astype(np.float32)
    Z = rng.normal(size=(200, D)).astype(np.float32)
    local = np.array([1, 4, 6])
    head = PersonalizedHead(W, b, local)
    pred = head.predict(Z)
    # Reference: global logits with non-local classes masked to -inf.
    logits = Z @ W.T + b
    mask = np.full(C, -np.inf)
    mask[local] = 0
    np.testing.assert_array_equal(pred, (logits + mask).argmax(axis=1))
    assert set(pred) <= set(local.tolist())
    y = rng.choice(local, 200)
    s = head.score(Z, y)
    assert s.correct == int((pred == y).sum()) and s.total == 200 and s.fallback == 0


def test_fallback_policy_for_labels_outside_the_local_set():
    rng = np.random.default_rng(1)
    W, b = rng.normal(size=(C, D)).astype(np.float32), rng.normal(size=C).astype(np.float32)
    Z = rng.normal(size=(100, D)).astype(np.float32)
    y = rng.integers(0, C, 100)
    local = np.array([0, 3])
    with pytest.raises(OutOfLocalLabels):
        PersonalizedHead(W, b, local).score(Z, y)
    s = PersonalizedHead(W, b, local, fallback="global").score(Z, y)
    inside = np.isin(y, local)
    glob = (Z @ W.T + b).argmax(axis=1)
    loc = PersonalizedHead(W, b, local).predict(Z)
    assert s.fallback == int((~inside).sum())
    assert s.correct == int((loc[inside] == y[inside]).sum() + (glob[~inside] == y[~inside]).sum())
    with pytest.raises(ValueError):
        PersonalizedHead(W, b, local, fallback="ignore")


def test_fine_tune_trains_the_pruned_head_with_local_indices():
    rng = np.random.default_rng(2)
    W, b = rng.normal(size=(C, D)).astype(np.float32), rng.normal(size=C).astype(np.float32)
    local = np.array([2, 8])
    y = rng.choice(local, 60)
    Z = (rng.normal(size=(60, D)) + 2.0 * (y[:, None] == 8)).astype(np.float32)
    head = PersonalizedHead(W, b, local)
    recipe = LocalTraining(epochs=5, batch_size=16, lr=0.01, seed=3)
    ref = train_head(W[local], b[local], Z, (y == 8).astype(np.int64), recipe)
    head.fine_tune(Z, y, recipe)
    np.testing.assert_array_equal(head.weight, ref.weight)
    np.testing.assert_array_equal(head.bias, ref.bias)
    assert head.weight.shape == (2, D)
    np.testing.assert_array_equal(head.global_weight, W)       # the global head is untouched
    with pytest.raises(OutOfLocalLabels):
        head.fine_tune(Z, np.full(60, 5), recipe)


def test_learning_rate_rule():
    assert oll_learning_rate(0.1, fed3r_init=True) == pytest.approx(0.001)
    assert oll_learning_rate(0.1, fed3r_init=False) == pytest.approx(0.01)
    r = fp_recipe(base_lr=0.1, fed3r_init=True, seed=5)
    assert (r.epochs, r.batch_size, r.temperature, r.seed) == (25, 64, 0.1, 5)
    assert r.lr == pytest.approx(0.001)
