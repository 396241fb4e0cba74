"""Export's training parity check refuses broken training programs (a review's findings; they
were written to the bundle):

(a) the loss was measured (``loss_abs_error``) but never compared with any tolerance: a program
    whose loss is wrong (but whose gradients are right) passed;
(b) per-tensor errors were combined with Python's ``max`` (parity.py and pipeline.py
    ``worst``), which ignores a NaN that is not first: a program whose *bias* gradient is
    NaN (so its SGD step makes the bias NaN) passed, because max(weight_error, nan) == weight_error.

The eager training backend is wrapped to produce each defect; only the eager runtime is exported
(no ExecuTorch lowering), so this runs in a second.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import export.pipeline as pipeline
from edge_client.runtime.eager_runtime import EagerTrainer
from edge_client.runtime.training import TRAINING_BACKENDS
from protocols.bundle_manifest import InputNormalisation, Manifest

C, D, B = 3, 8, 4


class LossOffByOne(EagerTrainer):
    def forward_backward(self, features, labels, sample_weight):
        loss, grads = super().forward_backward(features, labels, sample_weight)
        return loss + 1.0, grads


class NanBiasGradient(EagerTrainer):
    def forward_backward(self, features, labels, sample_weight):
        loss, grads = super().forward_backward(features, labels, sample_weight)
        return loss, {**grads, "bias": np.full_like(grads["bias"], np.nan)}


def _export_training(monkeypatch, trainer_cls) -> list[str]:
    monkeypatch.setattr(pipeline, "DEFAULT_TRAINING_RUNTIMES", ("eager",))
    monkeypatch.setitem(TRAINING_BACKENDS, "eager", lambda data, spec, manifest: trainer_cls(data, spec, manifest))
    rng = np.random.default_rng(0)
    draft = Manifest(backbone="mobilenet_v2", weights_sha256="0" * 64, feature_dim=D, num_classes=C, temperature=0.1,
                     output="features", input=InputNormalisation(8, (0.0,) * 3, (1.0,) * 3), artifacts=(),
                     created_with={})
    src = SimpleNamespace(features=rng.normal(size=(16, D)).astype(np.float32), tail=None, activations=None,
                          head={"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)},
                          draft=draft, parity_images=SimpleNamespace(labels=np.arange(16) % C, source="test"))
    r = SimpleNamespace(batch_size=B, num_classes=C, temperature=0.1, gradient_tolerance=1e-5)
    failures: list[str] = []
    artifacts = pipeline._training_artifacts(r, src, failures)
    return failures, artifacts[0].spec.parity


@pytest.mark.parametrize("trainer_cls", [LossOffByOne, NanBiasGradient], ids=["wrong-loss", "nan-bias-gradient"])
def test_a_broken_training_program_fails_its_parity_check(monkeypatch, trainer_cls):
    failures, parity = _export_training(monkeypatch, trainer_cls)
    assert failures, f"the broken program passed its parity check; recorded parity: {parity}"
