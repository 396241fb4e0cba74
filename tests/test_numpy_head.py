"""The torch-free head step (edge_client.tasks.numpy_head) against the eager torch head step on the
same data, and train_head on a device where ``import torch`` fails."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edge_client.tasks.head_training import LocalTraining, _TorchHeadStepper, local_sgd, train_head
from edge_client.tasks.numpy_head import NumpyHeadStepper, train_heads_together

ROOT = Path(__file__).resolve().parents[1]


def _problem(seed=0, n=130, d=24, c=7):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(c, d)).astype(np.float32) * 0.1, rng.normal(size=c).astype(np.float32) * 0.1,
            rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, c, n).astype(np.int64))


@pytest.mark.parametrize("recipe", [LocalTraining(), LocalTraining(epochs=3, batch_size=16, lr=0.05,
                                                                   weight_decay=0.0, temperature=1.0, seed=4)])
def test_numpy_head_step_equals_the_eager_torch_step(recipe):
    weight, bias, features, labels = _problem()
    ours, theirs = NumpyHeadStepper(weight, bias, recipe), _TorchHeadStepper(weight, bias, recipe)
    assert ours.step(features[:50], labels[:50]) == pytest.approx(theirs.step(features[:50], labels[:50]), rel=1e-5)
    steps_a, loss_a = local_sgd(ours, len(labels), features, labels, recipe)
    steps_b, loss_b = local_sgd(theirs, len(labels), features, labels, recipe)
    assert steps_a == steps_b and loss_a == pytest.approx(loss_b, rel=1e-4)
    for name, value in theirs.parameters().items():
        np.testing.assert_allclose(ours.parameters()[name], value, rtol=1e-4, atol=1e-5)
    assert not np.allclose(ours.parameters()["weight"], weight)          # it did train


def test_train_head_runs_in_numpy_where_torch_cannot_be_imported():
    weight, bias, features, labels = _problem(seed=1)
    expected = local_sgd(_TorchHeadStepper(weight, bias, LocalTraining()), len(labels), features, labels,
                         LocalTraining())[1]
    code = """
import sys, json
sys.modules['torch'] = None
import numpy as np
from edge_client.tasks.head_training import LocalTraining, train_head
rng = np.random.default_rng(1)
c, d, n = 7, 24, 130
w = rng.normal(size=(c, d)).astype(np.float32) * 0.1; b = rng.normal(size=c).astype(np.float32) * 0.1
f = rng.normal(size=(n, d)).astype(np.float32); y = rng.integers(0, c, n).astype(np.int64)
t = train_head(w, b, f, y, LocalTraining())
print(json.dumps({"runtime": t.runtime, "loss": t.mean_loss, "torch": sys.modules['torch'] is None}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["runtime"] == "numpy" and got["torch"]
    assert got["loss"] == pytest.approx(expected, rel=1e-4)


def test_heads_trained_together_equal_each_head_trained_alone_in_eager_torch():
    """Row sets of different sizes (so their schedules end at different steps, and their last
    batches are short) × two rates, weight decay on: each head as train_head trains it alone."""
    weight, bias, features, labels = _problem(seed=2, n=150, d=24, c=5)
    rng = np.random.default_rng(7)
    row_sets = [np.sort(rng.choice(150, n, replace=False)) for n in (150, 97, 64, 33)]
    lrs = [0.01, 0.05]
    recipe = LocalTraining(epochs=4, batch_size=32, lr=1.0, weight_decay=0.01, temperature=0.5, seed=3)
    weights, biases = train_heads_together(weight, bias, features, labels, row_sets, lrs, recipe)
    assert weights.shape == (4, 2, 5, 24) and biases.shape == (4, 2, 5)
    for g, rows in enumerate(row_sets):
        for i, lr in enumerate(lrs):
            alone = train_head(weight, bias, features[rows], labels[rows], replace(recipe, lr=lr))
            assert alone.runtime == "torch"
            np.testing.assert_allclose(weights[g, i], alone.weight, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(biases[g, i], alone.bias, rtol=1e-4, atol=1e-5)
    assert not np.allclose(weights[3, 1], weight)


def test_a_batch_size_past_the_rows_trains_as_one_batch_of_them_without_padding():
    """A review's finding: every step padded its batch to the task's batch_size (allowed up to 2^30),
    so 65,536 over 200 rows took 1.1 GB. A batch holds at most the largest row set: the heads are
    those of a batch_size of the rows, bit for bit, and the step's arrays stay that small."""
    import tracemalloc

    weight, bias, features, labels = _problem(seed=4, n=40, d=8, c=3)
    row_sets = [np.arange(40), np.arange(0, 40, 2)]
    recipe = LocalTraining(epochs=2, batch_size=40, lr=0.5, seed=1)
    want = train_heads_together(weight, bias, features, labels, row_sets, [0.1, 0.2], recipe)
    tracemalloc.start()
    got = train_heads_together(weight, bias, features, labels, row_sets, [0.1, 0.2], replace(recipe, batch_size=2**22))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert all(np.array_equal(w, g) for w, g in zip(want, got))
    assert peak < 2**20, peak              # padded: (2 row sets x 2^22) indices alone were 64 MiB


def test_cross_validated_rate_scores_equal_fold_by_fold_training_in_eager_torch():
    """choose_fp_lr's scores against the loop it replaces: one PersonalizedHead per (rate, fold),
    fine-tuned alone (train_head, eager torch) and scored on its held-out fold."""
    from edge_client.oll import PersonalizedHead, choose_fp_lr

    weight, bias, features, labels = _problem(seed=3, n=203, d=24, c=7)
    labels = np.where(labels % 3 == 0, 1, labels % 3 + 3)           # three local labels of seven
    recipe = LocalTraining(epochs=5, batch_size=16, lr=1.0, weight_decay=4e-5, temperature=0.1, seed=5)
    lrs, folds = [1e-3, 3e-2], 5
    chosen, scores = choose_fp_lr(weight, bias, features, labels, recipe, lrs, folds)
    parts = np.array_split(np.random.default_rng(recipe.seed).permutation(len(labels)), folds)
    expected = {}
    for lr in lrs:
        correct = 0
        for k, held in enumerate(parts):
            fit = np.concatenate([p for j, p in enumerate(parts) if j != k])
            head = PersonalizedHead(weight, bias, labels, fallback="global")
            head.fine_tune(features[fit], labels[fit], replace(recipe, lr=lr))
            correct += head.score(features[held], labels[held]).correct
        expected[lr] = correct / len(labels)
    assert scores == pytest.approx(expected, abs=1.5 / len(labels))   # a borderline row may flip in the last bit
    assert expected[lrs[0]] != expected[lrs[1]] and chosen == max(lrs, key=lambda lr: expected[lr])


def test_a_batch_schedule_draws_each_epoch_when_it_is_reached():
    """A review's finding: the schedule was a list of every step's batch, epochs x rows positions
    (400 MB for 10,000 epochs over 5,000 rows, within the step budget). It holds one epoch now, and
    its batches are still each epoch's numpy permutation of the rows, cut in order."""
    import tracemalloc

    from protocols.payloads.fedavg import batch_schedule

    rng, want = np.random.default_rng(11), []
    for _ in range(3):
        order = rng.permutation(7)
        want += [order[i:i + 3] for i in range(0, 7, 3)]
    small = batch_schedule(7, 3, 3, 11)
    assert len(small) == 9 and [b.tolist() for b in small] == [b.tolist() for b in want]
    assert [b.tolist() for b in small] == [b.tolist() for b in want]            # iterable again, the same
    tracemalloc.start()
    try:
        big = batch_schedule(5000, 10_000, 5000, 3)
        steps = sum(1 for _ in big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert steps == len(big) == 10_000 and peak < 1 << 20, peak


def test_cross_validation_counts_every_head_against_the_work_budget(monkeypatch):
    """A review's finding: OLL's learning-rate choice trains folds x rates heads, each within the work
    budget alone (MAX_LOCAL_WORK), 20 x 16 = 320 of them in one task. The heads trained together
    count as one task (the Java device's FpLearningRate counts the same (folds - 1) x n rows). The
    budget is made small here (10^13 multiply-adds would take hours if a regression let them run)."""
    import re

    from edge_client.agent import TaskDeclined
    from protocols.payloads import fedavg

    monkeypatch.setattr(fedavg, "MAX_LOCAL_WORK", 10 ** 8)
    classes, d, n, epochs, folds, rates = 10, 99, 100, 100, 20, 16
    one_head = classes * (d + 1)
    assert fedavg.check_local_work(n, epochs, one_head) <= fedavg.MAX_LOCAL_WORK     # one head alone is within it
    rng = np.random.default_rng(0)
    features, labels = rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, classes, n)
    row_sets = [np.delete(np.arange(n), np.arange(g, n, folds)) for g in range(folds)]   # each fold's training rows
    recipe = LocalTraining(epochs=epochs, batch_size=n, lr=0.1)
    total = epochs * sum(map(len, row_sets)) * rates * one_head
    assert total > fedavg.MAX_LOCAL_WORK
    with pytest.raises(TaskDeclined, match=re.escape(f"is {total:.2e} multiply-adds, more than a device takes (1e+08)")):
        train_heads_together(np.zeros((classes, d), np.float32), np.zeros(classes, np.float32), features, labels,
                             row_sets, [0.01 * (i + 1) for i in range(rates)], recipe)


def test_heads_past_the_lockstep_budget_train_in_groups_to_the_same_heads(monkeypatch):
    """Heads past MAX_LOCKSTEP_BYTES move in groups, one after another: bit for bit the heads of one
    lockstep over all of them (groups of rates, of row sets, and of both)."""
    from edge_client.tasks import numpy_head

    weight, bias, features, labels = _problem(seed=6, n=90, d=12, c=4)
    rng = np.random.default_rng(1)
    row_sets = [np.sort(rng.choice(90, n, replace=False)) for n in (90, 61, 45, 30, 17)]
    lrs = [0.01, 0.03, 0.1]
    recipe = LocalTraining(epochs=3, batch_size=20, lr=1.0, weight_decay=0.01, temperature=0.5, seed=2)
    whole = train_heads_together(weight, bias, features, labels, row_sets, lrs, recipe)
    per_head = 4 * (6 * 20 * 4 + 4 * 4 * 13 + 20 * 12)
    for heads in (1, 2, 4, 7):           # one head; rates split; a few row sets of every rate; uneven
        monkeypatch.setattr(numpy_head, "MAX_LOCKSTEP_BYTES", heads * per_head)
        assert numpy_head.heads_per_lockstep(20, 4, 12) == heads
        got = train_heads_together(weight, bias, features, labels, row_sets, lrs, recipe)
        assert all(np.array_equal(w, g) for w, g in zip(whole, got)), heads


def test_a_personalize_task_of_every_fold_and_rate_holds_a_bounded_working_set(monkeypatch):
    """A review's finding: an ``oll.personalize`` task's cross-validation trained its fp_folds x fp_lrs
    heads (up to 20 x 16) in one lockstep, in batches of up to every row, so its steps held G x B x d
    features and G x L x B x k logits at once (0.9 GB at 1,000 rows of 100 local classes; honest
    tasks, 5 folds x 2 rates in batches of 64, a few MB). The handler, with the params as they come
    off the wire, now holds about MAX_LOCKSTEP_BYTES whatever the task asks, and chooses the rate
    and scores it chose with every head in one lockstep."""
    import tracemalloc

    from edge_client import oll
    from edge_client.tasks import numpy_head
    from edge_client.tasks.personalization import PersonalizeTask
    from protocols.payloads.personalize import PersonalizeParams
    from protocols.payloads.task_params import ModelSpec

    n, k, d = 600, 40, 128
    rng = np.random.default_rng(0)
    features, labels = rng.normal(size=(n, d)).astype(np.float32), np.arange(n) % k

    class Features:
        feature_dim = d

        def extract(self, images):
            return np.asarray(images, np.float32)

    task = PersonalizeTask(features, labels, features[:40], labels[:40], lambda b, s, w: Features())
    params = PersonalizeParams(model=ModelSpec(num_classes=k, backbone="b", image_size=8), feature_dim=d, fp_epochs=1,
                               batch_size=2**20, fp_lrs=tuple(0.01 * (i + 1) for i in range(16)), fp_folds=20).to_params()
    head = {"weight": rng.normal(size=(k, d)).astype(np.float32) * 0.01, "bias": np.zeros(k, np.float32)}
    chose = []
    monkeypatch.setattr("edge_client.tasks.personalization.choose_fp_lr",
                        lambda *a: chose.append(oll.choose_fp_lr(*a)) or chose[-1])
    tracemalloc.start()
    body, _ = task(params, head)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1.5 * numpy_head.MAX_LOCKSTEP_BYTES, peak / 2**20       # one lockstep of 320 heads: 300 MB
    monkeypatch.setattr(numpy_head, "MAX_LOCKSTEP_BYTES", 2**40)          # every head at once: the reference
    body_at_once, _ = task(params, head)
    assert chose[0] == chose[1] and body == body_at_once and body["fp_lr"] in params["fp_lrs"]
