"""A task of several training passes is held to one step budget (``MAX_LOCAL_STEPS``) for all of
them, on the Python and the Java device: Ditto's global and personal passes, FedAlt's personal and
shared passes, FP(ψ)'s folds x rates fits and the chosen rate's fit. Each pass used to be checked
alone as it started, so one task asked up to twice the budget (Ditto, FedAlt), or 320 budgets (FP).
Each expected count is worked out here from epochs x ⌈rows / batch⌉, pass by pass."""

from __future__ import annotations

import numpy as np
import pytest

import java_build
from java_tasks import C, D, device_data, java_cp, run_java_task  # noqa: F401 (java_cp: a fixture)
from test_java_personalization import PERSONALIZE, java_personalize

from edge_client.agent import TaskDeclined
from edge_client.tasks import numpy_head, partial_training
from edge_client.tasks.ditto_training import ditto_pass
from edge_client.tasks.head_training import LocalTraining
from edge_client.tasks.numpy_head import NumpyHeadStepper
from edge_client.tasks.partial_training import train_partial
from protocols.payloads import fedavg
from protocols.payloads.ditto import DittoRecipe
from protocols.payloads.partial import PartialRecipe

needs_java = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

# 201 rows in batches of 2 is 101 steps an epoch: 5,500 epochs (555,500 steps) and 4,500 epochs
# (454,500) are each within the budget alone, 1,010,000 together
ROWS, BATCH, FIRST, SECOND = 201, 2, 5_500, 4_500
TOGETHER = FIRST * 101 + SECOND * 101
ZERO = {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}
STATE = {"run": "0123abcd", "round": 1}


def steps(rows: int, epochs: int, batch: int) -> int:
    """epochs x ⌈rows / batch⌉, counted batch by batch."""
    per_epoch = len(range(0, rows, batch))
    return epochs * per_epoch


def ditto(features, labels, epochs, personal_epochs, batch):
    return ditto_pass(ZERO["weight"], ZERO["bias"], ZERO, features, labels,
                      LocalTraining(epochs=epochs, batch_size=batch, lr=1e-3), DittoRecipe(0.1, personal_epochs, 1e-3))


def fedalt(features, labels, epochs, personal_epochs, batch):
    return train_partial(ZERO["weight"], ZERO["bias"], features, labels,
                         PartialRecipe(epochs=epochs, personal_epochs=personal_epochs, batch_size=batch, lr=1e-3))


TWO_PASSES = {"ditto": ditto, "fedalt": fedalt}


def counting_steps(monkeypatch) -> list[int]:
    """Every SGD step Ditto (NumpyHeadStepper) and FedAlt (head_sgd_step) take, counted."""
    taken = [0]
    step, sgd_step = NumpyHeadStepper.step, partial_training.head_sgd_step

    def counted(real):
        def run(*a, **k):
            taken[0] += 1
            return real(*a, **k)
        return run
    monkeypatch.setattr(NumpyHeadStepper, "step", counted(step))
    monkeypatch.setattr(partial_training, "head_sgd_step", counted(sgd_step))
    return taken


@pytest.mark.parametrize("kind", sorted(TWO_PASSES))
def test_both_passes_count_against_the_step_budget_before_either_trains(kind, monkeypatch):
    features, labels = device_data(0, ROWS)
    assert steps(ROWS, FIRST, BATCH) <= fedavg.MAX_LOCAL_STEPS and steps(ROWS, SECOND, BATCH) <= fedavg.MAX_LOCAL_STEPS
    assert steps(ROWS, FIRST, BATCH) + steps(ROWS, SECOND, BATCH) == TOGETHER > fedavg.MAX_LOCAL_STEPS
    taken = counting_steps(monkeypatch)
    with pytest.raises(TaskDeclined, match=f" is {TOGETHER} SGD steps, more than a device takes"):
        TWO_PASSES[kind](features, labels, FIRST, SECOND, BATCH)
    assert taken[0] == 0


@pytest.mark.parametrize("kind", sorted(TWO_PASSES))
def test_the_count_is_the_steps_the_task_takes(kind, monkeypatch):
    """With the budget at the hand count the task trains and takes exactly that many steps; one
    below it, it is declined before any (each pass alone stays within it)."""
    features, labels = device_data(1, 20)                  # 20 rows in batches of 3: 7 steps an epoch
    count = steps(20, 2, 3) + steps(20, 3, 3)
    assert count == 35
    taken = counting_steps(monkeypatch)
    for module in (fedavg, numpy_head):
        monkeypatch.setattr(module, "MAX_LOCAL_STEPS", count)
    TWO_PASSES[kind](features, labels, 2, 3, 3)
    assert taken[0] == count
    for module in (fedavg, numpy_head):
        monkeypatch.setattr(module, "MAX_LOCAL_STEPS", count - 1)
    with pytest.raises(TaskDeclined, match=f" is {count} SGD steps"):
        TWO_PASSES[kind](features, labels, 2, 3, 3)
    assert taken[0] == count                               # nothing more


# FP(ψ): 90 rows in 4 folds (held-out parts 23, 23, 22, 22: fits of 67, 67, 68, 68 rows), 3 rates,
# batches of 1, 1,200 epochs: the 12 fits are 972,000 steps, within the budget, and the chosen
# rate's fit on all 90 rows (108,000 more) takes the task past it
FP_ROWS, FP_FOLDS, FP_RATES, FP_EPOCHS = 90, 4, [0.0005, 0.02, 0.2], 1_200
FP_FITS = [FP_ROWS - len(part) for part in np.array_split(np.arange(FP_ROWS), FP_FOLDS)]
FP_CV = len(FP_RATES) * sum(steps(fit, FP_EPOCHS, 1) for fit in FP_FITS)
FP_TOTAL = FP_CV + steps(FP_ROWS, FP_EPOCHS, 1)
FP_PARAMS = {**PERSONALIZE, "fp_epochs": FP_EPOCHS, "batch_size": 1, "fp_folds": FP_FOLDS, "fp_lrs": FP_RATES}


def fp_data():
    from java_tasks import personal_data

    rng = np.random.default_rng(4)
    head = {"weight": (rng.normal(size=(C, D)) * 0.3).astype(np.float32),
            "bias": (rng.normal(size=C) * 0.1).astype(np.float32)}
    return head, personal_data(1, FP_ROWS, [0, 1, 3]), personal_data(2, 40, [0, 1, 2, 3])


def test_fp_psi_counts_its_cross_validation_and_the_chosen_rates_fit(monkeypatch):
    from ops_fleet import Features

    from edge_client import oll
    from edge_client.tasks.personalization import PersonalizeTask

    assert FP_FITS == [67, 67, 68, 68] and FP_CV == 972_000 <= fedavg.MAX_LOCAL_STEPS < FP_TOTAL == 1_080_000
    monkeypatch.setattr(oll, "train_heads_together", lambda *a: pytest.fail("a head was trained"))
    monkeypatch.setattr(oll, "train_head", lambda *a: pytest.fail("a head was trained"))
    head, train, held_out = fp_data()
    with pytest.raises(TaskDeclined, match=f"over {FP_FOLDS} folds, then the chosen rate's fit on all {FP_ROWS} "
                                           f"samples, .* is {FP_TOTAL} SGD steps, more than a device takes"):
        PersonalizeTask(*train, *held_out, lambda b, s, w: Features(D))(FP_PARAMS, head)


def python_reason(call) -> str:
    with pytest.raises(TaskDeclined) as declined:
        call()
    return str(declined.value)


@needs_java
@pytest.mark.parametrize("kind", sorted(TWO_PASSES))
def test_the_java_device_declines_both_passes_alike(java_cp, tmp_path, kind):
    features, labels = device_data(0, ROWS)
    params = {"num_classes": C, "feature_dim": D, "backbone": "b", "image_size": 8, "job_id": "j-1", "state": STATE,
              "batch_size": BATCH, "lr": 1e-3}
    if kind == "ditto":
        params.update(epochs=FIRST, ditto_lambda=0.1, personal_epochs=SECOND, personal_lr=1e-3)
    else:
        params.update(epochs=FIRST, personal_epochs=SECOND, algorithm="fedalt")
    task_kind = "ditto.head" if kind == "ditto" else "pp.head"
    out, result = run_java_task(java_cp, tmp_path, params, ZERO, (features, labels), task_kind, tmp_path / "state")
    assert out.startswith("DECLINED") and result is None, out
    assert f" is {TOGETHER} SGD steps, more than a device takes" in out
    python = python_reason(lambda: TWO_PASSES[kind](features, labels, FIRST, SECOND, BATCH))
    assert python in out, (python, out)                    # the same words on both devices
    assert list((tmp_path / "state").iterdir()) == []      # nothing kept


@needs_java
def test_the_java_device_counts_fp_psi_as_the_python_device(java_cp, tmp_path):
    from ops_fleet import Features

    from edge_client.tasks.personalization import PersonalizeTask

    head, train, held_out = fp_data()
    out, lines, result = java_personalize(java_cp, tmp_path, FP_PARAMS, head, train, held_out)
    assert result is None and "DECLINED" in out and f" is {FP_TOTAL} SGD steps" in out, out
    python = python_reason(lambda: PersonalizeTask(*train, *held_out, lambda b, s, w: Features(D))(FP_PARAMS, head))
    assert python in out, (python, out)
