"""The Java device's ``fed3r.stats`` against the Python device's: a streaming task's increment
and a DP task's clipped, capped statistics (bad ones declined), and the exact factor form."""

from __future__ import annotations

import numpy as np
import pytest

import java_build
from ops_fleet import kept_windows
from java_tasks import C, D, FED3R_PARAMS, device_data, java_cp, run_java_task  # noqa: F401 (java_cp: a fixture)

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


@pytest.mark.parametrize("extra", [{"from_sample": 0}, {"from_sample": 25},
                                   {"feature_clip_norm": 1.5, "max_samples": 20, "cap_samples": True},
                                   {"from_sample": 10, "feature_clip_norm": 2.0, "max_samples": 9, "cap_samples": True},
                                   {"feature_clip_norm": 1.5, "max_samples": 20, "cap_samples": True, "cap_by_weight": True}],
                         ids=["stream-start", "stream-increment", "dp-clip-cap", "dp-increment", "dp-weighed"])
def test_fed3r_stats_streaming_and_dp_equal_the_python_device(java_cp, tmp_path, extra):
    """A streaming task's increment (the samples after from_sample, echoed) and a DP task's
    clipped rows and capped sample count (its first max_samples, or all 37 weighed to 20): the Java
    device's statistics are the Python device's (both accumulate in float64; relative difference
    ≤ 1e-12, summation order only)."""
    from ops_fleet import Features

    from edge_client.tasks.fed3r_stats import Fed3RStatsTask

    Z, y = device_data(1)
    params = {**FED3R_PARAMS, **extra}
    out, result = run_java_task(java_cp, tmp_path, params, {}, (Z, y), kind="fed3r.stats", state=tmp_path / "java")
    assert out.startswith("DONE"), out
    body, tensors = Fed3RStatsTask(Z, y, lambda b, s, w: Features(D), windows=kept_windows(tmp_path / "python"))(params, None)
    for k in ("n", "from_sample"):
        assert result.body.get(k) == body.get(k), k
    assert set(result.tensors) == set(tensors)
    for k, ref in tensors.items():
        got = result.tensors[k]
        assert got.dtype == ref.dtype and got.shape == ref.shape, k
        assert np.abs(got - ref).max() <= 1e-12 * max(1.0, np.abs(ref).max()), k
    if extra.get("cap_samples"):       # the clipping bit: unclipped statistics would differ
        _, unclipped = Fed3RStatsTask(Z, y, lambda b, s, w: Features(D), windows=kept_windows(tmp_path / "other"))(
            {**params, "feature_clip_norm": 0.0}, None)
        assert not np.allclose(unclipped["A_upper"], tensors["A_upper"])


@pytest.mark.parametrize("extra, reason", [({"from_sample": 37}, "no new samples"),
                                           ({"from_sample": 40}, "holds 40 samples of this device, it has 37"),
                                           ({"feature_clip_norm": -1.0}, "feature_clip_norm"),
                                           ({"cap_samples": True}, "max_samples"),
                                           ({"max_samples": 3, "cap_by_weight": True}, "cap_by_weight needs cap_samples")])
def test_bad_streaming_and_dp_fed3r_tasks_are_declined(java_cp, tmp_path, extra, reason):
    out, _ = run_java_task(java_cp, tmp_path, {**FED3R_PARAMS, **extra}, {}, device_data(1), kind="fed3r.stats")
    assert out.startswith("DECLINED") and reason in out, out


def factor_data(n: int, dim: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """ReLU-like features with dead channels (zero in every row), a column parallel to another and
    a repeated image (two equal rows): what the canonical factor has to handle on real devices."""
    rng = np.random.default_rng(31)
    Z = np.maximum(rng.normal(size=(n, dim)), 0).astype(np.float32)
    Z[:, [3, 17]] = 0.0
    Z[:, 9] = 2 * Z[:, 4]
    Z[-1] = Z[0]
    return Z, rng.integers(0, C, n)


@pytest.mark.parametrize("n, dtype, cap", [(12, "float64", None), (12, "float32", None), (60, "float64", None),
                                           (12, "float64", 5)],
                         ids=["factor", "factor-float32", "n>=p:packed", "factor-weighed"])
def test_fed3r_factor_form_equals_the_python_device(java_cp, tmp_path, n, dtype, cap):
    """The exact factor form (a task with "factor": true): the Java device sends what the Python
    device sends, the canonical R and QtY within 1e-12 of the largest entry (float64 Householder
    steps in the same order; summation order only), the same zero_columns, class_ids and body, and
    the aggregator's parser accepts it (canonical form, A and b consistent with n); with n ≥ p both
    send the packed triangle. Weighed (a DP cap by weight of 5 of the 12 samples): R and QtY both
    times √(5/12), n = 5."""
    from ops_fleet import Features

    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from protocols.payloads.fed3r import parse_stats

    Z, y = factor_data(n)
    params = {**FED3R_PARAMS, "factor": True, "dtype": dtype}
    if cap:
        params.update(feature_clip_norm=1e6, max_samples=cap, cap_samples=True, cap_by_weight=True)
    # no state folder on either device: a cap by weight covers all the samples, a window answered without one
    out, result = run_java_task(java_cp, tmp_path, params, {}, (Z, y), kind="fed3r.stats")
    assert out.startswith("DONE"), out
    body, tensors = Fed3RStatsTask(Z, y, lambda b, s, w: Features(Z.shape[1]))(params, None)
    assert body["n"] == (cap or n)
    assert {k: result.body[k] for k in body} == body and set(result.tensors) == set(tensors)
    assert (body.get("a_format") == "factor") == (n < Z.shape[1] + 1)
    for k, ref in tensors.items():
        got = result.tensors[k]
        assert got.dtype == ref.dtype and got.shape == ref.shape, k
        tol = 1e-12 if dtype == "float64" else 2 * np.finfo(np.float32).eps
        assert np.abs(got.astype(np.float64) - ref).max() <= tol * max(1.0, np.abs(ref).max()), k
    parse_stats(result, Z.shape[1] + 1, C, weighed=bool(cap))

