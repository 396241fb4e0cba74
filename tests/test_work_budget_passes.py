"""A task of several training passes is held to one work budget (``MAX_LOCAL_WORK``, multiply-adds)
for all of them, on the Python and the Java device, as it is to one step budget
(test_step_budget_passes.py): Ditto's global and personal passes, FedAlt's personal and shared
passes, FP(ψ)'s folds x rates fits and the chosen rate's fit. And a FedSAM/FedASAM step, which
evaluates the gradient twice (at w and at w + ε̂), counts twice. The work of a pass is
epochs x rows x C(d + 1) x the gradient evaluations of a step; each expected count is worked out
here pass by pass, and where the task trains, measured against the gradients it evaluates.

The Python device's budget is made small here (10^13 multiply-adds would take hours if a
regression let them run); the Java device's cannot be, so its tasks are past the real budget only
together and declined before any step."""

from __future__ import annotations

import re

import numpy as np
import pytest

import java_build
from java_tasks import C, D, RECIPE, device_data, java_cp, run_java_task  # noqa: F401 (java_cp: a fixture)
from test_java_personalization import PERSONALIZE, java_personalize

from edge_client.agent import TaskDeclined
from edge_client.tasks import numpy_head
from edge_client.tasks.ditto_training import ditto_pass
from edge_client.tasks.head_training import LocalTraining, local_sgd, train_head
from edge_client.tasks.numpy_head import NumpyHeadStepper, head_size
from edge_client.tasks.partial_training import train_partial
from protocols.payloads import fedavg
from protocols.payloads.ditto import DittoRecipe
from protocols.payloads.fedavg import LocalRuleRecipe
from protocols.payloads.partial import PartialRecipe

needs_java = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

STATE = {"run": "0123abcd", "round": 1}
RULES = {"sgd": 1, "sam": 2, "asam": 2}          # gradient evaluations a step: SAM's second is at w + ε̂


def head(classes: int) -> dict[str, np.ndarray]:
    return {"weight": np.zeros((classes, D), np.float32), "bias": np.zeros(classes, np.float32)}


def ditto(start, features, labels, epochs, personal_epochs, batch, rule="sgd"):
    recipe = LocalTraining(epochs=epochs, batch_size=batch, lr=1e-3, rule=LocalRuleRecipe(local_rule=rule))
    return ditto_pass(start["weight"], start["bias"], start, features, labels, recipe,
                      DittoRecipe(0.1, personal_epochs, 1e-3))


def fedalt(start, features, labels, epochs, personal_epochs, batch, rule="sgd"):
    assert rule == "sgd"                          # FedAlt's passes are plain SGD (partial_training.sgd_epochs)
    return train_partial(start["weight"], start["bias"], features, labels,
                         PartialRecipe(epochs=epochs, personal_epochs=personal_epochs, batch_size=batch, lr=1e-3))


TWO_PASSES = {"ditto": ditto, "fedalt": fedalt}
KINDS = [("ditto", "sgd"), ("ditto", "sam"), ("ditto", "asam"), ("fedalt", "sgd")]


def work_budget(monkeypatch, budget: int) -> None:
    monkeypatch.setattr(fedavg, "MAX_LOCAL_WORK", budget)
    monkeypatch.setattr(numpy_head, "MAX_LOCAL_WORK", budget, raising=False)    # numpy_head's name for it


def measuring_work(monkeypatch) -> list[int]:
    """The multiply-adds the task's gradients take, measured: each gradient evaluation's rows x the
    head's parameters (every NumpyHeadStepper step and head_sgd_step goes through it)."""
    done = [0]
    real = numpy_head.head_loss_and_gradients

    def measured(weight, bias, features, *rest):
        done[0] += len(features) * (np.size(weight) + np.size(bias))
        return real(weight, bias, features, *rest)
    monkeypatch.setattr(numpy_head, "head_loss_and_gradients", measured)
    return done


def work(rows: int, epochs: int, classes: int, evaluations: int = 1) -> int:
    """epochs x rows x C(d + 1) x the gradient evaluations of a step."""
    return epochs * rows * classes * (D + 1) * evaluations


@pytest.mark.parametrize("kind, rule", KINDS)
def test_the_work_counted_is_the_work_the_task_takes(kind, rule, monkeypatch):
    """With the budget at the hand count the task trains and its gradients take exactly that work;
    one below it, it is declined before any gradient (each pass alone stays within it)."""
    features, labels = device_data(1, 20)
    first, second = work(20, 2, C, RULES[rule]), work(20, 3, C, RULES[rule])    # 1,120 and 1,680 x evaluations
    count = first + second
    assert count == 2800 * RULES[rule]
    done = measuring_work(monkeypatch)
    work_budget(monkeypatch, count)
    TWO_PASSES[kind](head(C), features, labels, 2, 3, 3, rule)
    assert done[0] == count
    work_budget(monkeypatch, count - 1)
    assert max(first, second) <= count - 1                          # each pass alone within the budget
    with pytest.raises(TaskDeclined, match=re.escape(f" is {count:.2e} multiply-adds, more than a device takes")):
        TWO_PASSES[kind](head(C), features, labels, 2, 3, 3, rule)
    assert done[0] == count                                         # nothing more


@pytest.mark.parametrize("rule", ["sam", "asam"])
def test_a_sharpness_aware_step_counts_two_gradient_evaluations_of_work(rule, monkeypatch):
    """One pass (fedavg.head's, Scaffold's, FedGloSS's: numpy_head.batch_schedule): with the budget at
    2 x epochs x rows x C(d + 1) a SAM pass trains and takes exactly that; below it, declined before
    any gradient, though the plain count (half of it) is within."""
    features, labels = device_data(2, 20)
    recipe = LocalTraining(epochs=3, batch_size=6, lr=1e-3, rule=LocalRuleRecipe(local_rule=rule))
    count = work(20, 3, C, evaluations=2)
    assert count == 3360
    done = measuring_work(monkeypatch)
    work_budget(monkeypatch, count)
    start = head(C)
    local_sgd(NumpyHeadStepper(start["weight"], start["bias"], recipe), 20, features, labels, recipe,
              head_size(start["weight"], start["bias"]))
    assert done[0] == count
    work_budget(monkeypatch, count - 1)
    assert work(20, 3, C) <= count - 1
    with pytest.raises(TaskDeclined, match=re.escape(f"through {C * (D + 1)} head parameters, 2 gradient evaluations a step, "
                                                     f"is {count:.2e} multiply-adds")):
        train_head(start["weight"], start["bias"], features, labels, recipe)
    assert done[0] == count


# FP(ψ): 90 rows of 3 local classes (a pruned head of 3 x 7 parameters) in 4 folds (fits of 67, 67,
# 68, 68 rows: 270), 3 rates, 6 epochs: the 12 fits are 6 x 21 x 3 x 270 = 102,060 multiply-adds,
# and the chosen rate's fit on all 90 rows 6 x 21 x 90 = 11,340 more
FP_ROWS, FP_EPOCHS, FP_RATES = 90, 6, [0.0005, 0.02, 0.2]
FP_PER_ROW = 3 * (D + 1)
FP_CV = FP_EPOCHS * FP_PER_ROW * len(FP_RATES) * (4 - 1) * FP_ROWS
FP_TOTAL = FP_CV + FP_EPOCHS * FP_PER_ROW * FP_ROWS


def test_fp_psi_counts_the_chosen_rates_fit_with_its_cross_validation(monkeypatch):
    from java_tasks import personal_data
    from ops_fleet import Features

    from edge_client import oll
    from edge_client.tasks.personalization import PersonalizeTask

    assert (FP_CV, FP_TOTAL) == (102_060, 113_400)
    work_budget(monkeypatch, 110_000)                               # the cross-validation alone is within it
    monkeypatch.setattr(oll, "train_heads_together", lambda *a: pytest.fail("a head was trained"))
    monkeypatch.setattr(oll, "train_head", lambda *a: pytest.fail("a head was trained"))
    params = {**PERSONALIZE, "fp_epochs": FP_EPOCHS, "fp_lrs": FP_RATES, "fp_folds": 4}
    train, held_out = personal_data(1, FP_ROWS, [0, 1, 3]), personal_data(2, 40, [0, 1, 2, 3])
    with pytest.raises(TaskDeclined, match=f"over 4 folds, then the chosen rate's fit on all {FP_ROWS} samples, "
                                           f".* is {re.escape(f'{FP_TOTAL:.2e}')} multiply-adds, more than a device takes"):
        PersonalizeTask(*train, *held_out, lambda b, s, w: Features(D))(params, head(C))


def python_reason(call) -> str:
    with pytest.raises(TaskDeclined) as declined:
        call()
    return str(declined.value)


# The Java device's real budget: 100,000 classes (700,000 head parameters), 2,000 rows in one batch
# an epoch. Two passes of 4,000 epochs are 5.6e12 multiply-adds each, within 10^13 alone, 1.12e13
# together; one SAM pass of 5,000 epochs is 7e12 counted once, 1.4e13 at its two gradients a step.
BIG, ROWS = 100_000, 2000


@needs_java
@pytest.mark.parametrize("kind", sorted(TWO_PASSES))
def test_the_java_device_declines_two_passes_past_the_work_budget_alike(java_cp, tmp_path, kind):
    each, together = work(ROWS, 4000, BIG), 2 * work(ROWS, 4000, BIG)
    assert each <= fedavg.MAX_LOCAL_WORK < together == 1.12e13
    rng = np.random.default_rng(5)
    features, labels = rng.normal(size=(ROWS, D)).astype(np.float32), rng.integers(0, 10, ROWS)
    params = {"num_classes": BIG, "feature_dim": D, "backbone": "b", "image_size": 8, "job_id": "j-1",
              "state": STATE, "batch_size": ROWS, "lr": 1e-3, "epochs": 4000, "personal_epochs": 4000}
    if kind == "ditto":
        params.update(ditto_lambda=0.1, personal_lr=1e-3)
    else:
        params.update(algorithm="fedalt")
    task_kind = "ditto.head" if kind == "ditto" else "pp.head"
    out, result = run_java_task(java_cp, tmp_path, params, head(BIG), (features, labels), task_kind, tmp_path / "state")
    assert out.startswith("DECLINED") and result is None, out
    assert f" is {together:.2e} multiply-adds, more than a device takes (1e+13)" in out
    python = python_reason(lambda: TWO_PASSES[kind](head(BIG), features, labels, 4000, 4000, ROWS))
    assert python in out, (python, out)                    # the same words on both devices
    assert list((tmp_path / "state").iterdir()) == []      # nothing kept


@needs_java
def test_the_java_device_counts_a_sam_step_as_two_gradient_evaluations(java_cp, tmp_path):
    once = work(ROWS, 5000, BIG)
    assert once <= fedavg.MAX_LOCAL_WORK < 2 * once == 1.4e13
    rng = np.random.default_rng(6)
    features, labels = rng.normal(size=(ROWS, D)).astype(np.float32), rng.integers(0, 10, ROWS)
    params = {**RECIPE, "num_classes": BIG, "epochs": 5000, "batch_size": ROWS, "local_rule": "sam", "sam_rho": 0.1}
    out, result = run_java_task(java_cp, tmp_path, params, head(BIG), (features, labels))
    assert out.startswith("DECLINED") and result is None, out
    assert f"2 gradient evaluations a step, is {2 * once:.2e} multiply-adds" in out
    python = python_reason(lambda: train_head(*head(BIG).values(), features, labels,
                                              LocalTraining.from_params(params)))
    assert python in out, (python, out)


@needs_java
def test_the_java_device_counts_fp_psi_as_the_python_device(java_cp, tmp_path):
    """7,500 rows, each its own class (a pruned head of 7,500 x 7 parameters), 2 folds of 3,750
    rows, 2 rates, 10,000 epochs in one batch an epoch: the 4 fits are 7.875e12 multiply-adds,
    within the budget, and the chosen rate's fit on all rows (3.94e12 more) takes the task past it."""
    from ops_fleet import Features

    from edge_client.tasks.personalization import PersonalizeTask

    n, epochs = 7500, 10_000
    cv, total = epochs * n * (D + 1) * 2 * n, epochs * n * (D + 1) * 3 * n
    assert cv <= fedavg.MAX_LOCAL_WORK < total == 1.18125e13
    rng = np.random.default_rng(7)
    train = rng.normal(size=(n, D)).astype(np.float32), rng.permutation(n)
    held_out = rng.normal(size=(40, D)).astype(np.float32), rng.integers(0, n, 40)
    params = {**PERSONALIZE, "num_classes": n, "fp_epochs": epochs, "batch_size": n, "fp_folds": 2,
              "fp_lrs": [0.01, 0.02]}
    start = {"weight": rng.normal(size=(n, D)).astype(np.float32), "bias": np.zeros(n, np.float32)}
    out, lines, result = java_personalize(java_cp, tmp_path, params, start, train, held_out)
    assert result is None and "DECLINED" in out and f" is {total:.2e} multiply-adds" in out, out
    python = python_reason(lambda: PersonalizeTask(*train, *held_out, lambda b, s, w: Features(D))(params, start))
    assert python in out, (python, out)
