"""The vectors the Java device masks against the Python device's: ``fedavg.secure`` ([n·θ | n] of
its trained head, clipped when the task bounds the update; out-of-bounds heads and malformed params
declined), distributed DP's rounded and noised ``fedavg.secure`` and ``fed3r.secure`` vectors, a
noise too large to draw declined by both devices, and the Skellam noise share's distribution."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

import java_build
from ops_fleet import kept_windows
from test_java_device import write_features
from java_tasks import (C, D, FED3R_PARAMS, HEAD_ATOL, RECIPE, device_data, java, java_cp,  # noqa: F401 (java_cp: a fixture)
                        state_args, task_bytes)

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


@pytest.mark.parametrize("change, reason", [({}, None), ({"vector_order": ["bias", "weight"]}, None),
                                            ({"vector_order": ["weight"]}, "does not name exactly"),
                                            ({"max_abs_param": 0.01}, "> the round's bound 0.01"),
                                            ({"max_samples": 10}, "exceed the round's bound of 10"),
                                            ({"dp": {"clip_norm": 1.0, "stddev": 0.1}}, "scale_bits"),
                                            ({"dp": {"stddev": 0.1, "scale_bits": 16}}, "needs its clip_norm"),
                                            ({"update_clip_norm": 0.5}, None), ({"update_clip_norm": 0.0}, None),
                                            ({"group": ""}, "needs its group"), ({"lr": 0}, "lr must be")])
def test_secure_fedavg_vector_is_the_python_devices(java_cp, tmp_path, change, reason):
    """fedavg.secure: the vector the Java device masks is [n·θ in vector_order | n] of its trained
    head (θ_t + the update clipped to update_clip_norm when the task sets one), the Python device's
    (protocols.payloads.secagg.pack_weighted, SecureUpdate.clipped_delta) within n·HEAD_ATOL; heads
    beyond the round's bounds and malformed params are declined with a reason."""
    from edge_client.tasks.head_training import LocalTraining, train_head
    from edge_client.tasks.secure_update import SecureUpdate
    from protocols.payloads.secagg import pack_weighted

    Z, y = device_data(0)
    head = {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}
    params = {**RECIPE, "group": "g1", "max_samples": 100, "max_abs_param": 20.0, **change}
    (tmp_path / "task.bin").write_bytes(task_bytes(params, head, "fedavg.secure"))
    proc = subprocess.run(java_build.java_command("-cp", java_cp, "TaskRunner", str(tmp_path / "task.bin"),
                                                  str(write_features(tmp_path / "f.feat", Z, y)),
                                                  str(tmp_path / "unused.bin")),
                          capture_output=True, text=True, timeout=60)
    if reason is not None:
        assert proc.stdout.startswith("DECLINED") and reason in proc.stdout, proc.stdout + proc.stderr[-2000:]
        return
    got = np.array(proc.stdout.split()[1:], dtype=np.float64)
    trained = train_head(head["weight"], head["bias"], Z, y, LocalTraining.from_params(RECIPE))
    tensors = {"weight": trained.weight, "bias": trained.bias}
    if change.get("update_clip_norm"):        # bounded influence: θ_t + clip(θ_k − θ_t); 0 means no clip
        delta = SecureUpdate.clipped_delta(change["update_clip_norm"], tensors, head)
        assert np.linalg.norm(trained.weight) > 2 * change["update_clip_norm"]      # the clipping bites
        tensors = {k: np.asarray(head[k], np.float64) + delta[k] for k in tensors}
    want = pack_weighted(tensors, params.get("vector_order", ["weight", "bias"]), len(y))
    assert got.shape == want.shape and got[-1] == len(y)
    assert np.abs(got - want).max() <= len(y) * HEAD_ATOL


def java_vector(java_cp, tmp_path, params, tensors, kind, data, state=None) -> np.ndarray:
    (tmp_path / "task.bin").write_bytes(task_bytes(params, tensors, kind))
    out = java(java_cp, tmp_path / "task.bin", write_features(tmp_path / "f.feat", *data), tmp_path / "x.bin",
               *state_args(state))
    assert out.startswith("VECTOR"), out
    return np.array(out.split()[1:], dtype=np.float64)


GRID_BITS = 16      # the rounds' scale_bits here: the vectors lie on the 2^-16 grid


def test_secure_vectors_under_distributed_dp_are_the_python_devices(java_cp, tmp_path):
    """Distributed DP: fedavg.secure sends [clip(θ_k − θ_t) | 1] and fed3r.secure the clipped,
    capped statistics with count 0, both rounded to the 2^-f grid with the device's noise share.
    With a negligible noise (μ ≈ 1e-9 ring units) the Java vectors are the Python device's rounded
    ones within one grid step (+ HEAD_ATOL for the trained head)."""
    from ops_fleet import Features

    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from edge_client.tasks.head_training import LocalTraining, train_head
    from edge_client.tasks.secure_update import SecureUpdate
    from protocols.payloads.secagg import pack_sync_vector, pack_weighted

    Z, y = device_data(0)
    head = {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}
    dp = {"clip_norm": 0.5, "stddev": 1e-9, "scale_bits": GRID_BITS}
    got = java_vector(java_cp, tmp_path, {**RECIPE, "group": "g", "max_samples": 100, "max_abs_param": 20.0, "dp": dp},
                      head, "fedavg.secure", (Z, y))
    trained = train_head(head["weight"], head["bias"], Z, y, LocalTraining.from_params(RECIPE))
    delta = SecureUpdate.clipped_delta(dp["clip_norm"], {"weight": trained.weight, "bias": trained.bias}, head)
    want = np.rint(np.ldexp(pack_weighted(delta, ["weight", "bias"], 1), GRID_BITS)) / 2.0 ** GRID_BITS
    assert np.linalg.norm(trained.weight) > 1.0                       # the clipping bites
    assert got[-1] == 1.0 and np.all(np.ldexp(got, GRID_BITS) == np.rint(np.ldexp(got, GRID_BITS)))
    assert np.abs(got - want).max() <= 2.0 ** -GRID_BITS + HEAD_ATOL

    params = {**FED3R_PARAMS, "group": "g", "max_samples": 20, "feature_clip_norm": 2.0, "cap_samples": True,
              "dp": {"stddev": 1e-9, "scale_bits": GRID_BITS}}
    got = java_vector(java_cp, tmp_path, params, {}, "fed3r.secure", device_data(1), state=tmp_path / "java")
    _, stats = Fed3RStatsTask(*device_data(1), lambda b, s, w: Features(D), windows=kept_windows(tmp_path / "python"))(
        dict(params, format="dense", dtype="float64"))
    want = np.rint(np.ldexp(pack_sync_vector(stats["A_upper"], stats["b"], 0), GRID_BITS)) / 2.0 ** GRID_BITS
    assert got[-1] == 0.0 and np.abs(got - want).max() <= 2.0 ** -GRID_BITS


@pytest.mark.parametrize("clip_norm", [0.5, 100.0], ids=["beyond-C", "within-C"])
def test_the_clipped_indicator_bit_under_adaptive_clipping_is_the_python_devices(java_cp, tmp_path, clip_norm):
    """Adaptive clipping under distributed DP (the task's dp.clip_bit_scale s): both devices send
    [clip(θ_k − θ_t) | (b − ½)·s | 1], b = 1[‖θ_k − θ_t‖ ≤ C] before the clip, the bit noised with
    the update (negligible noise here): the Java vector is the Python device's within a grid step,
    and the bit entry is ±s/2 by the norm computed here."""
    from edge_client.tasks.head_training import LocalTraining, train_head
    from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining
    from protocols.identity import DeviceIdentity

    Z, y = device_data(0)
    head = {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}
    dp = {"clip_norm": clip_norm, "stddev": 1e-9, "scale_bits": GRID_BITS, "clip_bit_scale": 1.5}
    params = {**RECIPE, "group": "g", "max_samples": 100, "max_abs_param": 20.0, "dp": dp}
    got = java_vector(java_cp, tmp_path, params, head, "fedavg.secure", (Z, y))
    trained = train_head(head["weight"], head["bias"], Z, y, LocalTraining.from_params(RECIPE))
    norm = float(np.sqrt(np.sum(np.square(trained.weight, dtype=np.float64)) +
                         np.sum(np.square(trained.bias, dtype=np.float64))))
    assert (norm <= clip_norm) == (clip_norm == 100.0)
    assert got.shape == (C * D + C + 2,) and got[-1] == 1.0
    assert got[-2] == (0.75 if norm <= clip_norm else -0.75)
    python = SecureFedAvgTraining(DeviceIdentity.generate("d"), bytes(32), lambda p, t: ({"n": len(y)}, {
        "weight": trained.weight, "bias": trained.bias}), noise_rng=np.random.default_rng(0))
    want = python.vector(params, head)
    assert np.abs(got - want).max() <= 2.0 ** -GRID_BITS + HEAD_ATOL
    (tmp_path / "task.bin").write_bytes(task_bytes({**params, "dp": {**dp, "clip_bit_scale": -1.0}}, head,
                                                   "fedavg.secure"))
    out = java(java_cp, tmp_path / "task.bin", write_features(tmp_path / "f.feat", Z, y), tmp_path / "x.bin")
    assert out.startswith("DECLINED") and "dp.clip_bit_scale" in out, out


@pytest.mark.parametrize("stddev, scale_bits", [(32.0, 29), (2.0 ** 31, 1), (2.0 ** 20, 12)])
def test_a_noise_too_large_to_draw_is_declined_by_both_devices(java_cp, tmp_path, stddev, scale_bits):
    """Found by the differential fuzzer: a dp round whose Poisson mean μ = (σ·2^f)²/2 is past what
    numpy draws (~9.2e18) was declined by the Python device ("lam value too large") but taken by
    the Java one, whose PTRS candidate saturated at Long.MAX_VALUE in both draws: a zero noise, an
    un-noised release. Both decline it now, by the one declared limit (POISSON_LAM_MAX); the limit
    itself is still drawn by numpy."""
    from ops_fleet import Features

    from edge_client.agent import TaskDeclined
    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from edge_client.tasks.secure_fed3r import SecureFed3R
    from protocols.identity import DeviceIdentity

    from protocols.secagg.distributed_dp import POISSON_LAM_MAX

    assert (stddev * 2.0 ** scale_bits) ** 2 / 2 > POISSON_LAM_MAX
    params = {**FED3R_PARAMS, "group": "g", "max_samples": 20, "feature_clip_norm": 2.0, "cap_samples": True,
              "dp": {"stddev": stddev, "scale_bits": scale_bits}}
    (tmp_path / "task.bin").write_bytes(task_bytes(params, {}, "fed3r.secure"))
    out = java(java_cp, tmp_path / "task.bin", write_features(tmp_path / "f.feat", *device_data(1)), tmp_path / "x.bin",
               *state_args(tmp_path / "java"))
    assert out.startswith("DECLINED bad dp params") and "too large to draw" in out, out
    device = SecureFed3R(DeviceIdentity.generate("d"), bytes(32), Fed3RStatsTask(
        *device_data(1), lambda b, s, w: Features(D), windows=kept_windows(tmp_path / "python")))
    with pytest.raises(TaskDeclined, match="too large to draw"):
        device.vector(params, {})
    assert np.isfinite(np.random.default_rng(0).poisson(POISSON_LAM_MAX))      # the limit itself is drawn


@pytest.mark.parametrize("mu", [0.5, 50.0, 1e9])
def test_skellam_noise_share_has_the_right_distribution(java_cp, mu):
    """The noise share: Poisson(μ) − Poisson(μ) integers (multiplication method below μ = 10,
    PTRS above), mean 0 and variance 2μ within 5 standard errors over 20 000 draws, and the same
    distribution as numpy's draws (two-sample Kolmogorov-Smirnov, p > 1e-4)."""
    from scipy.stats import ks_2samp

    n = 20_000
    draws = np.array(java(java_cp, "--skellam", np.sqrt(2 * mu), n).split()[1:], dtype=np.float64)
    assert draws.shape == (n,)
    var = 2 * mu
    assert abs(draws.mean()) <= 5 * np.sqrt(var / n)
    assert abs(draws.var() / var - 1) <= 5 * np.sqrt((2 + 1 / mu) / n)      # Skellam's excess kurtosis: 1/(2μ)
    rng = np.random.default_rng(0)
    assert ks_2samp(draws, rng.poisson(mu, n) - rng.poisson(mu, n)).pvalue > 1e-4

