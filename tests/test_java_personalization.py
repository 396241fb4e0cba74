"""The Java device's ``oll.personalize`` against the Python device's: OLL's pruning and label
map, the FP(ψ) rate's cross-validation and the fine-tuned head; bad tasks declined with a reason."""

from __future__ import annotations

import numpy as np
import pytest

import java_build
from test_differential_fuzz import head_tolerance
from test_java_device import write_features
from java_tasks import C, D, java, java_cp, personal_data, task_bytes  # noqa: F401 (java_cp: a fixture)

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


PERSONALIZE = {"num_classes": C, "feature_dim": D, "backbone": "b", "image_size": 8, "weights_sha256": "",
               "fallback": "global", "fp_epochs": 6, "batch_size": 16, "fp_lrs": [0.0005, 0.02, 0.2], "fp_folds": 4,
               "weight_decay": 4e-5, "temperature": 0.1, "seed": 3}


def java_personalize(java_cp, tmp_path, params, head, train, held_out):
    from protocols.envelope import decode

    (tmp_path / "task.bin").write_bytes(task_bytes(params, head, "oll.personalize"))
    out = java(java_cp, tmp_path / "task.bin", write_features(tmp_path / "train.feat", *train), tmp_path / "result.bin",
               write_features(tmp_path / "test.feat", *held_out))
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    return out, lines, (decode((tmp_path / "result.bin").read_bytes()) if "DONE" in lines else None)


@pytest.mark.parametrize("fp_epochs", [0, 6])
def test_oll_and_fp_personalization_equal_the_python_device(java_cp, tmp_path, fp_epochs):
    """OLL's pruning and label map, the FP(ψ) rate's cross-validation (same folds, same per-fold
    training) and the fine-tuned head: the Java device reports the Python device's counts and
    rate exactly, and holds the Python device's personalised head within the derived head_tolerance
    (the same float32-vs-float64 argument as fedavg.head). The counts are exactly equal because no held-out
    or cross-validation sample lies within that tolerance of a decision boundary here (checked)."""
    from ops_fleet import Features

    from edge_client.oll import PersonalizedHead, choose_fp_lr
    from edge_client.tasks.head_training import LocalTraining
    from edge_client.tasks.personalization import PersonalizeTask
    from protocols.payloads.personalize import parse_report

    train, held_out = personal_data(1, 90, [0, 1, 3]), personal_data(2, 40, [0, 1, 2, 3])   # label 2: fallback
    rng = np.random.default_rng(4)
    head = {"weight": (rng.normal(size=(C, D)) * 0.3).astype(np.float32), "bias": (rng.normal(size=C) * 0.1).astype(np.float32)}
    params = {**PERSONALIZE, "fp_epochs": fp_epochs}
    out, lines, result = java_personalize(java_cp, tmp_path, params, head, train, held_out)
    assert result is not None, out
    report = parse_report(result, C, with_fp=bool(fp_epochs))
    python = PersonalizeTask(*train, *held_out, lambda b, s, w: Features(D))
    body, _ = python(params, head)
    assert {k: result.body[k] for k in body} == body and report.fallback > 0 and report.local_classes == 3
    weight = np.array(lines["OLL_WEIGHT"], dtype=np.float32).reshape(3, D)
    bias = np.array(lines["OLL_BIAS"], dtype=np.float32)
    steps = fp_epochs * -(-len(train[1]) // params["batch_size"])
    tol = head_tolerance({**params, "lr": report.fp_lr or 0.0}, head, train[0], steps, params["batch_size"],
                         {"weight": weight, "bias": bias}, {"weight": python.head.weight, "bias": python.head.bias})
    diff = max(np.abs(weight - python.head.weight).max(), np.abs(bias - python.head.bias).max())
    assert diff <= tol
    # no held-out sample near a boundary of the Python head: the counts' equality is not luck (heads
    # that differ by diff move a logit by at most diff·(‖f‖₁ + 1), a gap between two by twice that)
    logits = np.sort(held_out[0] @ python.head.weight.T + python.head.bias, axis=1)
    assert (logits[:, -1] - logits[:, -2]).min() > 2 * diff * (np.abs(held_out[0]).sum(axis=1).max() + 1)
    if fp_epochs:
        recipe = LocalTraining.from_params({**params, "epochs": fp_epochs})
        lr, scores = choose_fp_lr(head["weight"], head["bias"], train[0], train[1], recipe, params["fp_lrs"], 4)
        assert [float(s) for s in lines["CV"]] == [scores[float(x)] for x in params["fp_lrs"]]
        assert report.fp_lr == lr and len(set(scores.values())) > 1      # the rates differ: the choice is tested
        assert not np.allclose(python.head.weight, PersonalizedHead(head["weight"], head["bias"], train[1]).weight)


@pytest.mark.parametrize("change, reason", [({"fallback": "error"}, "OLL with fallback='error'"),
                                            ({"fallback": "maybe"}, "fallback must be one of"),
                                            ({"fp_lrs": []}, "at least one learning rate"),
                                            ({"fp_lrs": [0.1, -1]}, "finite and > 0"),
                                            ({"tail_stages": 1}, "no tail bundle")])
def test_bad_personalization_tasks_are_declined(java_cp, tmp_path, change, reason):
    head = {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}
    out, _, _ = java_personalize(java_cp, tmp_path, {**PERSONALIZE, **change}, head,
                                 personal_data(1, 30, [0, 1]), personal_data(2, 20, [0, 1, 2]))
    assert out.startswith("DECLINED") and reason in out, out

