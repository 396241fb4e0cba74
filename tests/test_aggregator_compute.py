"""The aggregator's device choice: CUDA when present, CPU otherwise, and identical results."""

import numpy as np
import pytest
import torch

from aggregator.compute.device import pick_device
from aggregator.compute.ridge import ClosedFormRidge


def test_auto_falls_back_to_cpu_without_a_gpu(monkeypatch):
    monkeypatch.delenv("FEDFLEET_DEVICE", raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto").type == expected
    monkeypatch.setenv("FEDFLEET_DEVICE", "cpu")
    assert pick_device("auto").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no GPU"):
            pick_device("cuda")


def test_solution_is_the_same_on_every_available_device():
    rng = np.random.default_rng(0)
    Z, y = rng.normal(size=(400, 32)), rng.integers(0, 5, 400)
    ref = ClosedFormRidge(lam=0.1, device="cpu").fit(Z, y, 5)
    for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        m = ClosedFormRidge(lam=0.1, device=dev).fit(Z, y, 5)
        np.testing.assert_allclose(m.raw_weights_, ref.raw_weights_, rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(m.predict(Z), ref.predict(Z))


def test_corrupt_statistics_are_refused():
    A = -np.eye(4) * 10            # not a Gram matrix: A + λI is indefinite
    with pytest.raises(np.linalg.LinAlgError, match="positive definite"):
        ClosedFormRidge(lam=0.01, device="cpu").fit_statistics(A, np.zeros((4, 2)))
    with pytest.raises(ValueError, match="lam"):
        ClosedFormRidge(lam=0.0).fit_statistics(np.eye(3), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="shapes"):
        ClosedFormRidge(lam=0.1, device="cpu").fit_statistics(np.eye(3), np.zeros((4, 2)))


def test_compute_summary_follows_the_device_choice(monkeypatch):
    from aggregator.compute.summary import compute_summary
    from protocols.secagg.crypto import MAX_DEFAULT_MASK_WORKERS, default_mask_workers, usable_cores

    monkeypatch.setenv("FEDFLEET_DEVICE", "cpu")
    unmask = (f"cpu ({usable_cores()} processes)" if usable_cores() > MAX_DEFAULT_MASK_WORKERS
              else f"cpu ({default_mask_workers()} threads)")
    assert compute_summary() == {"device": "cpu", "gpu": None, "torch": torch.__version__, "secagg_unmask": unmask}
    monkeypatch.delenv("FEDFLEET_DEVICE")
    summary = compute_summary()
    assert summary["device"].startswith("cuda:" if torch.cuda.is_available() else "cpu")
    assert (summary["gpu"] is None) == (not torch.cuda.is_available())
