"""FP(φ)/FP(M) after OLL (edge_client/tasks/tail_personalization.py): the masked C-class head is
OLL's pruned head; the device's fine-tuning equals FT(φ)'s handler through the exported tail
program (the other runtime) on the same start; the count it reports is what its model gets right."""

import numpy as np
import pytest

from aggregator.jobs.personalize import PersonalizeConfig, PersonalizeJob
from edge_client.agent import TaskDeclined
from edge_client.oll import PersonalizedHead
from edge_client.tasks.head_training import LocalTraining
from edge_client.tasks.personalization import PersonalizeTask
from edge_client.tasks.tail_personalization import TailFineTuning, masked_head
from edge_client.tasks.tail_training import TailFeatures, TailTrainingTask
from protocols.payloads.fedavg import MAX_LOCAL_STEPS

C, D = 10, 1280          # the 32 px bundle's head


def test_the_masked_head_is_olls_pruned_head():
    rng = np.random.default_rng(0)
    W, b = rng.normal(size=(C, 16)).astype(np.float32), rng.normal(size=C).astype(np.float32)
    head = PersonalizedHead(W, b, np.array([1, 4, 7, 4]))
    f = (3 * rng.normal(size=(50, 16))).astype(np.float32)
    m = masked_head(head)
    logits = (f @ m["weight"].T + m["bias"]) / np.float32(0.1)
    np.testing.assert_array_equal(logits.argmax(1), head.predict(f))
    p = np.exp(logits - logits.max(axis=1, keepdims=True), dtype=np.float32)
    assert (p[:, [0, 2, 3, 5, 6, 8, 9]] == 0).all()            # absent classes: no probability, no gradient


class FrozenFeatures:
    """The frozen extractor of a tail bundle: its trunk and its pretrained tail."""

    def __init__(self, tail: TailFeatures):
        self.tail, self.feature_dim = tail, D

    def extract(self, images):
        return self.tail.extract(self.tail.bundled_parameters(), images)[0]


def device(tail_bundle, tail=True):
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 256, (24, 28, 28), dtype=np.uint8), rng.choice([0, 3, 5], 24)
    hx, hy = rng.integers(0, 256, (9, 28, 28), dtype=np.uint8), np.array([0, 3, 5, 0, 3, 5, 0, 3, 8])
    features = TailFeatures(tail_bundle)
    return PersonalizeTask(x, y, hx, hy, lambda *a, **k: FrozenFeatures(features),
                           tail_features=features if tail else None)


def job(part: str, **over) -> PersonalizeJob:
    rng = np.random.default_rng(1)
    head = {"weight": rng.normal(scale=0.05, size=(C, D)).astype(np.float32),
            "bias": rng.normal(scale=0.05, size=C).astype(np.float32)}
    return PersonalizeJob(PersonalizeConfig(**{
        "num_classes": C, "feature_dim": D, "image_size": 32, "fp_epochs": 2, "fp_lrs": [1e-3, 3e-2], "fp_folds": 2,
        "batch_size": 8, "fallback": "global", "fp_part": part, **over}), head=head)


@pytest.mark.parametrize("part", ["phi", "M"])
def test_fp_reports_what_the_devices_fine_tuned_model_gets_right(tail_bundle, part):
    task = device(tail_bundle)
    body, out = task(*job(part).task_for("dev0"))
    assert out == {} and body["fp_lr"] in (1e-3, 3e-2)
    model, head = task.fine_tuned, task.head
    start, masked = task.tail_features.bundled_parameters(), masked_head(head)
    assert any(not np.array_equal(model[k], start[k]) for k in start if k.startswith("tail."))     # the tail moved
    if part == "phi":
        np.testing.assert_array_equal(model["weight"], masked["weight"])                          # the head did not
        np.testing.assert_array_equal(model["bias"], masked["bias"])
    else:
        assert not np.array_equal(model["weight"][[0, 3, 5]], masked["weight"][[0, 3, 5]])
    # recomputed: the fine-tuned features and head on the local labels; the global head on the other one
    f = task.tail_features.extract(model, task.test_images)[0]
    inside = np.isin(task.test_labels, [0, 3, 5])
    correct = int(((f @ model["weight"].T + model["bias"]).argmax(1)[inside] == task.test_labels[inside]).sum())
    frozen = FrozenFeatures(task.tail_features).extract(task.test_images[~inside])
    correct += int(((frozen @ head.global_weight.T + head.global_bias).argmax(1) == task.test_labels[~inside]).sum())
    assert body["correct"]["oll_fp"] == correct


def test_fp_phi_trains_as_the_ft_phi_handler_does_through_the_exported_program(tail_bundle):
    task = device(tail_bundle)
    session = task.tail_features.session()
    head = PersonalizedHead(*(job("phi").head[k] for k in ("weight", "bias")), task.train_labels)
    start = {**task.tail_features.bundled_parameters(), **masked_head(head)}
    recipe = LocalTraining(epochs=2, batch_size=8, lr=0.03, temperature=0.1, seed=5)
    mine = TailFineTuning(session, start, "phi", recipe).fit(task.tail_features.activations(task.train_images),
                                                            task.train_labels, 0.03)
    ft = TailTrainingTask(task.train_images, task.train_labels, tail_bundle)        # ExecuTorch, FT(φ)'s handler
    params = {**recipe.to_params(), "num_classes": C, "tail_stages": 1, "train": "tail", "backbone": "mobilenet_v2",
              "image_size": 32}
    _, theirs = ft(params, start)
    assert theirs and set(theirs) == {k for k in start if k.startswith("tail.")}
    for name, value in theirs.items():
        np.testing.assert_allclose(mine[name], value, atol=1e-5, err_msg=name)


def test_fp_of_the_tail_is_declined_without_a_tail_bundle_or_with_a_bad_part(tail_bundle):
    with pytest.raises(TaskDeclined, match="no tail bundle"):
        device(tail_bundle, tail=False)(*job("M").task_for("dev0"))
    params, tensors = job("phi").task_for("dev0")
    with pytest.raises(TaskDeclined, match="fp_part"):
        device(tail_bundle)({**params, "fp_part": "tail"}, tensors)
    with pytest.raises(ValueError, match="fp_part"):
        job("everything")


@pytest.mark.parametrize("folds, rates, epochs", [(20, 16, 10_000), (20, 2, 1_080)])
def test_fp_of_the_tail_counts_every_cross_validation_fit_against_the_step_budget(tail_bundle, monkeypatch, folds,
                                                                                   rates, epochs):
    """FP(φ)'s cross-validation fits the tail once per fold and rate, each fit within the step budget
    alone: 20 folds x 16 rates of 10,000 epochs in batches of 1 over 24 rows (about 230,000 steps a fit)
    is 72 million steps through the tail program, hours of a phone's only task thread from one signed
    task. The chosen rate's fit on all rows follows, and counts too: 20 folds x 2 rates of 1,080 epochs
    are 984,960 steps, within the budget, and with the last fit's 25,920 past it. Declined before any
    fit, with the count (FP(ψ) counts alike: numpy_head.within_cross_validation_budget)."""
    task = device(tail_bundle)
    params, tensors = job("phi").task_for("dev0")
    rows = len(task.train_labels)
    fits = [rows - len(part) for part in np.array_split(np.arange(rows), folds)]
    per_fit = [epochs * fit for fit in fits]                     # batches of 1
    total = rates * sum(per_fit) + epochs * rows                # and the chosen rate's fit on all rows
    assert max(per_fit) <= MAX_LOCAL_STEPS < total               # each alone within, together past
    if rates == 2:
        assert rates * sum(per_fit) <= MAX_LOCAL_STEPS           # the folds' fits alone within, too
    monkeypatch.setattr(TailFineTuning, "fit", lambda *a: pytest.fail("a tail fit started"))
    hostile = {**params, "fp_epochs": epochs, "batch_size": 1, "fp_folds": folds,
               "fp_lrs": [1e-4 * (i + 1) for i in range(rates)]}
    with pytest.raises(TaskDeclined, match=f" is {total} SGD steps"):
        task(hostile, tensors)
