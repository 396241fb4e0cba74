"""On-device training of the linear head (and the backbone's tail) through a training program.

Two programs share this code: ``training`` (the head; input: features (B, d)) and
``tail_training`` (the backbone's last stages + the head, for FT(φ)/FT(M); input: the
trunk's activations (B, c, h, w)). "Rows" below are rows of that input.

The program has a fixed batch B (static shapes). :class:`TrainingSession` turns any
mini-batch of n rows into program calls:

* n <= B: one call, rows n..B-1 padded with zeros and given sample weight 0, so the loss
  and gradients are exactly those of the n real rows;
* n > B: ceil(n / B) calls; chunk c's loss and gradients are averages over its n_c rows,
  so the mini-batch values are the n_c / n weighted sums. Then one SGD step.

The SGD update itself is the runtime's (ExecuTorch's ``SGD`` optimizer; the eager backend
does ``p -= lr * g``). Labels are local class indices 0..C-1 (see OLL in the Fed3R spec).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np

from edge_client.runtime.base import check_parameter_dict
from edge_client.runtime.errors import RuntimeUnavailableError
from edge_client.runtime.eager_runtime import EagerTrainer
from edge_client.runtime.executorch_runtime import ExecuTorchTrainer
from protocols.bundle_manifest import ArtifactSpec, Manifest
from edge_client.runtime.selection import open_first_available
from edge_client.runtime.verification import load_manifest

__all__ = ["TRAINING_BACKENDS", "TRAINING_RUNTIMES", "TrainingSession"]

TRAINING_RUNTIMES = ("executorch", "eager")

# runtime name -> factory(verified file bytes, artifact spec, manifest) -> head trainer
TRAINING_BACKENDS = {
    "executorch": lambda data, spec, manifest: ExecuTorchTrainer(data, spec),
    "eager": lambda data, spec, manifest: EagerTrainer(data, spec, manifest),
}


class TrainingSession:
    """Head parameters living in a runtime, updated by SGD steps on feature mini-batches."""

    def __init__(self, trainer, spec: ArtifactSpec, manifest: Manifest):
        self._trainer = trainer
        self._spec = spec
        self.manifest = manifest
        self.batch_size: int = spec.batch.max
        self.kind = spec.kind
        self.num_classes = manifest.num_classes
        self.feature_dim = manifest.feature_dim
        self.input_shape: tuple[int, ...] = tuple(spec.inputs[0].shape[1:])   # one row's shape
        self.parameter_shapes: dict[str, tuple[int, ...]] = {
            name: tuple(shape) for name, shape in spec.details["trainable_parameters"].items()}

    @property
    def runtime(self) -> str:
        return self._trainer.runtime

    @classmethod
    def load(cls, manifest_path: str | Path, prefer: Sequence[str] = TRAINING_RUNTIMES,
             expected_manifest_sha256: str | None = None,
             kind: str = "training") -> "TrainingSession":
        """Verify the ``kind`` program's sha256 ("training": the head; "tail_training": the
        backbone's tail + the head), then load it in the first usable runtime."""
        if kind not in ("training", "tail_training"):
            raise ValueError(f"kind must be 'training' or 'tail_training', got {kind!r}")
        manifest = load_manifest(manifest_path, expected_manifest_sha256)
        trainer = open_first_available(manifest, kind, prefer, TRAINING_BACKENDS)
        return cls(trainer, manifest.find(kind, trainer.runtime), manifest)

    def set_parameters(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite every trainable tensor, e.g. {"weight": (C, d), "bias": (C,)} from Fed3R
        (plus the ``tail.*`` tensors for a tail_training program)."""
        self._trainer.set_parameters(check_parameter_dict(values, self.parameter_shapes))

    def get_parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters, read back from the runtime."""
        return self._trainer.get_parameters()

    def features(self, rows: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """What the head sees for these input rows under the current parameters: the tail's
        output for a tail_training program. Only the eager twin can say: an ExecuTorch training
        program returns loss and logits, not its features."""
        if not hasattr(self._trainer, "features"):
            raise RuntimeUnavailableError(
                f"the {self.runtime} {self._spec.kind} program gives loss and logits only; load the "
                "bundle's eager twin (prefer=('eager',)) for its features")
        rows = np.asarray(rows, dtype=np.float32)
        return np.concatenate([self._trainer.features(rows[start:start + batch_size])
                               for start in range(0, len(rows), batch_size)]) if len(rows) else rows

    def loss_and_gradients(self, features: np.ndarray,
                           labels: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """Mean loss over the rows and its gradients, without changing the parameters."""
        features, labels = self._check_batch(features, labels)
        total = len(features)
        loss = 0.0
        gradients: dict[str, np.ndarray] = {}
        for start in range(0, total, self.batch_size):
            rows = min(self.batch_size, total - start)
            chunk_loss, chunk_gradients = self._trainer.forward_backward(
                *self._padded(features[start:start + rows], labels[start:start + rows]))
            share = rows / total
            loss += share * chunk_loss
            for name, grad in chunk_gradients.items():
                if name in gradients:
                    gradients[name] += np.float32(share) * grad
                else:
                    # A single chunk keeps the runtime's gradient bit for bit.
                    gradients[name] = grad.copy() if share == 1.0 else np.float32(share) * grad
        return loss, gradients

    def train_step(self, features: np.ndarray, labels: np.ndarray, lr: float,
                   trained: Collection[str] | None = None) -> float:
        """One SGD step (the runtime's SGD) on this mini-batch; returns its loss before the step.

        ``trained``: the tensors to update (default all); the others stay as they are, e.g. the
        head under FT(φ), which fine-tunes the tail against a frozen classifier.
        """
        lr = _check_learning_rate(lr)
        if trained is not None and not set(trained) <= set(self.parameter_shapes):
            raise ValueError(f"unknown tensors to train: {sorted(set(trained) - set(self.parameter_shapes))}")
        loss, gradients = self.loss_and_gradients(features, labels)
        if trained is not None:
            gradients = {name: grad for name, grad in gradients.items() if name in trained}
        self.sgd_step(gradients, lr)
        return loss

    def sgd_step(self, directions: dict[str, np.ndarray], lr: float) -> None:
        """p ← p − lr·d through the runtime's SGD for the named tensors: a step whose direction a
        local rule chose (``edge_client/tasks/local_rules.py``: SAM's gradient at w + ε̂, FedProx's pull)."""
        lr = _check_learning_rate(lr)
        unknown = set(directions) - set(self.parameter_shapes)
        if unknown:
            raise ValueError(f"unknown tensors to train: {sorted(unknown)}")
        for name, d in directions.items():
            if np.shape(d) != self.parameter_shapes[name]:
                raise ValueError(f"direction {name!r} has shape {np.shape(d)}, expected {self.parameter_shapes[name]}")
        self._trainer.sgd_step({name: np.asarray(d, dtype=np.float32) for name, d in directions.items()}, lr)

    def _padded(self, features: np.ndarray, labels: np.ndarray):
        rows = len(features)
        sample_weight = np.zeros(self.batch_size, dtype=np.float32)
        sample_weight[:rows] = 1.0
        if rows == self.batch_size:
            return features, labels, sample_weight
        padded_features = np.zeros((self.batch_size, *self.input_shape), dtype=np.float32)
        padded_features[:rows] = features
        padded_labels = np.zeros(self.batch_size, dtype=np.int64)
        padded_labels[:rows] = labels
        return padded_features, padded_labels, sample_weight

    def _check_batch(self, features: object, labels: object) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(features, np.ndarray) or not isinstance(labels, np.ndarray):
            raise TypeError("features and labels must be numpy arrays")
        if features.shape[1:] != self.input_shape:
            shape = ", ".join(map(str, self.input_shape))
            raise ValueError(f"inputs must have shape (n, {shape}), got {features.shape}")
        if len(features) == 0:
            raise ValueError("cannot train on an empty batch")
        if not np.issubdtype(features.dtype, np.floating):
            raise ValueError(f"features must be floating point, got {features.dtype}")
        if not np.isfinite(features).all():
            raise ValueError("features contain NaN or infinite values")
        if labels.shape != (len(features),):
            raise ValueError(
                f"labels must have shape ({len(features)},) to match the features, got {labels.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be integers (local class indices), got {labels.dtype}")
        if labels.min() < 0 or labels.max() >= self.num_classes:
            raise ValueError(
                f"labels must lie in [0, {self.num_classes}), got [{labels.min()}, {labels.max()}]")
        return (np.ascontiguousarray(features, dtype=np.float32),
                np.ascontiguousarray(labels, dtype=np.int64))


def _check_learning_rate(lr: object) -> float:
    if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating, np.integer)):
        raise TypeError(f"lr must be a number, got {type(lr).__name__}")
    lr = float(lr)
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a positive finite number, got {lr}")
    return lr
