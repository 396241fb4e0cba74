"""A task's global head as both devices read it: ``fedavg.head`` and ``oll.personalize`` (and the
secure FedAvg round, which trains through the plain handler) take a weight (C, d) and a bias (C,)
of float32 or float64, finite once rounded to float32, and decline anything else with the same
reason, in the same order (one tensor at a time: its presence, its shape, its dtype, its values).

What a review found (an aggregator sending a head whose dtype or shape disagrees with its params):
the Python device trained on an integer head (int32, uint8: cast to float32) that the Java device
declined; gave other words for a missing or misshapen tensor ("head shapes (6, 4), (4,) do not
match (4, 6)" against "head tensor weight has shape [6, 4], the task's params say [4, 6]") and
checked both tensors' shapes before either's values, so a head with a NaN weight and a short bias
got two different reasons; failed a float64 head past float32's range with an error out of
train_head where the Java device declined "global head contains NaN or Inf"; and the Java
device's personalization said "fedavg.head task carries no head tensor". A device's local label
outside the job's classes was quoted as its largest by the Python device (fed3r.stats took a
negative one), as its first by the Java device.
"""

from __future__ import annotations

import numpy as np
import pytest

import java_build
from fuzz_device import PrecomputedFeatures
from java_tasks import C, D, FED3R_PARAMS, RECIPE, device_data, java_cp, personal_data, run_java_task  # noqa: F401 (java_cp: a fixture)
from test_java_personalization import PERSONALIZE, java_personalize

from edge_client.agent import TaskDeclined
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from edge_client.tasks.head_training import HeadTrainingTask
from edge_client.tasks.personalization import PersonalizeTask

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

W = np.random.default_rng(5).normal(size=(C, D)).astype(np.float32)
B = np.zeros(C, np.float32)
HEADS = {
    "float64 head": {"weight": W.astype(np.float64), "bias": B.astype(np.float64)},
    "int32 weight": {"weight": W.astype(np.int32), "bias": B},
    "uint8 bias": {"weight": W, "bias": B.astype(np.uint8)},
    "int64 weight": {"weight": W.astype(np.int64), "bias": B},
    "transposed weight": {"weight": W.T.copy(), "bias": B},
    "weight of three axes": {"weight": W[None], "bias": B},
    "short bias": {"weight": W, "bias": B[:2]},
    "no bias": {"weight": W},
    "no weight": {"bias": B},
    "no head": {},
    "NaN weight and short bias": {"weight": np.full((C, D), np.nan, np.float32), "bias": B[:2]},
    "int8 weight and short bias": {"weight": np.zeros((C, D), np.int8), "bias": B[:1]},
    "float64 past float32's range": {"weight": np.full((C, D), 1e300), "bias": B},
    "empty head": {"weight": np.zeros((0, D), np.float32), "bias": np.zeros(0, np.float32)},
}


def python_answer(handler, params: dict, tensors: dict) -> str:
    try:
        handler(params, dict(tensors))
    except TaskDeclined as exc:
        return f"DECLINED {exc}"
    return "DONE"


def java_answer(out: str) -> str:
    return out.splitlines()[0].strip() if out.startswith("DECLINED") else "DONE"


@pytest.mark.parametrize("case", sorted(HEADS))
def test_fedavg_head_tasks_are_read_alike(java_cp, tmp_path, case):
    data = device_data(0)
    factory = lambda b, s, w: PrecomputedFeatures(D)       # noqa: E731
    out, _ = run_java_task(java_cp, tmp_path, RECIPE, HEADS[case], data)
    assert python_answer(HeadTrainingTask(*data, factory), RECIPE, HEADS[case]) == java_answer(out)


@pytest.mark.parametrize("case", sorted(HEADS))
def test_personalization_tasks_are_read_alike(java_cp, tmp_path, case):
    train, held_out = personal_data(1, 30, [0, 1]), personal_data(2, 20, [0, 1, 2])
    factory = lambda b, s, w: PrecomputedFeatures(D)       # noqa: E731
    params = {**PERSONALIZE, "fp_epochs": 0}
    out, _, _ = java_personalize(java_cp, tmp_path, params, HEADS[case], train, held_out)
    assert python_answer(PersonalizeTask(*train, *held_out, factory), params, HEADS[case]) == java_answer(out)



@pytest.mark.parametrize("labels", [[0, 2, 3], [0, -1, 3]])
@pytest.mark.parametrize("kind", ["fedavg.head", "fed3r.stats"])
def test_a_local_label_outside_the_jobs_classes_is_quoted_alike(java_cp, tmp_path, kind, labels):
    """The first such label in the device's data, by both devices (a larger one comes after it)."""
    Z, y = device_data(0)
    y = y.copy()
    y[:3] = labels
    factory = lambda b, s, w: PrecomputedFeatures(D)       # noqa: E731
    if kind == "fedavg.head":
        params, handler = {**RECIPE, "num_classes": 2}, HeadTrainingTask(Z, y, factory)
        head = {"weight": np.zeros((2, D), np.float32), "bias": np.zeros(2, np.float32)}
    else:
        params, handler, head = {**FED3R_PARAMS, "num_classes": 2}, Fed3RStatsTask(Z, y, factory), {}
    out, _ = run_java_task(java_cp, tmp_path, params, head, (Z, y), kind=kind)
    expected = f"DECLINED local label {labels[1]} outside the job's 2 classes"
    assert python_answer(handler, params, head) == java_answer(out) == expected


CENTERS = {
    "int32 center": np.arange(D, dtype=np.int32),
    "float32 center": np.linspace(-1, 1, D).astype(np.float32),
    "short center": np.zeros(D - 1),
    "center of two axes": np.zeros((1, D)),
    "NaN center": np.full(D, np.nan),
    "int8 center of two axes": np.zeros((1, D), np.int8),
}


@pytest.mark.parametrize("case", sorted(CENTERS) + ["no center"])
def test_a_centered_fed3r_tasks_feature_center_is_read_alike(java_cp, tmp_path, case):
    """A centered fed3r.stats task's feature_center: float32 or float64 (the Python device took an
    integer one), the feature dimension's values, finite; the same reason for each."""
    Z, y = device_data(0)
    factory = lambda b, s, w: PrecomputedFeatures(D)       # noqa: E731
    params = {**FED3R_PARAMS, "feature_clip_norm": 4.0, "centered": True}
    tensors = {} if case == "no center" else {"feature_center": CENTERS[case]}
    out, _ = run_java_task(java_cp, tmp_path, params, tensors, (Z, y), kind="fed3r.stats")
    assert python_answer(Fed3RStatsTask(Z, y, factory), params, tensors) == java_answer(out)
