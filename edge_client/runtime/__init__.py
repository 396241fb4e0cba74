"""Runtime layer: run exported bundles with ExecuTorch (default), ONNX Runtime or eager torch.

A bundle is a directory with ``manifest.json`` (see :mod:`protocols.bundle_manifest`)
and the files it lists. Every entry point verifies the sha256 of the file it loads against
the manifest first (:class:`ArtifactTamperedError` otherwise), then picks the first runtime
of ``prefer`` that the bundle offers and this machine has installed
(:class:`RuntimeUnavailableError`, naming the alternatives and their pip packages, when
none is). Importing this package imports no runtime; each is imported when first used.

    runtime = load_inference(bundle / "manifest.json")
    features = runtime.run(to_model_input(images, size, mean, std))

    session = TrainingSession.load(bundle / "manifest.json")
    session.set_parameters({"weight": W, "bias": b})
    loss = session.train_step(features, labels, lr=0.01)
    trained = session.get_parameters()
"""

from __future__ import annotations

from edge_client.runtime.base import InferenceRuntime
from edge_client.runtime.errors import (
    ArtifactError,
    ArtifactMissingError,
    ArtifactTamperedError,
    ManifestError,
    RuntimeUnavailableError,
)
from edge_client.runtime.inference import INFERENCE_BACKENDS, INFERENCE_RUNTIMES, load_inference
from protocols.bundle_manifest import Manifest, read_manifest
from edge_client.runtime.training import TRAINING_BACKENDS, TRAINING_RUNTIMES, TrainingSession
from edge_client.runtime.verification import file_sha256, load_manifest, verify_bundle

__all__ = [
    "INFERENCE_BACKENDS",
    "INFERENCE_RUNTIMES",
    "TRAINING_BACKENDS",
    "TRAINING_RUNTIMES",
    "ArtifactError",
    "ArtifactMissingError",
    "ArtifactTamperedError",
    "InferenceRuntime",
    "Manifest",
    "ManifestError",
    "RuntimeUnavailableError",
    "TrainingSession",
    "file_sha256",
    "load_inference",
    "load_manifest",
    "read_manifest",
    "verify_bundle",
]
