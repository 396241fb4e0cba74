"""Loading a bundle's inference artifact in the first usable runtime."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from edge_client.runtime.base import InferenceRuntime
from edge_client.runtime.eager_runtime import EagerInference
from edge_client.runtime.executorch_runtime import ExecuTorchInference
from edge_client.runtime.onnx_runtime import OnnxRuntimeInference
from edge_client.runtime.selection import open_first_available
from edge_client.runtime.verification import load_manifest

__all__ = ["INFERENCE_BACKENDS", "INFERENCE_RUNTIMES", "load_inference"]

INFERENCE_RUNTIMES = ("executorch", "onnxruntime", "eager")

# runtime name -> factory(verified file bytes, artifact spec, manifest) -> runtime object
INFERENCE_BACKENDS = {
    "executorch": lambda data, spec, manifest: ExecuTorchInference(
        data, spec, manifest.input.image_size),
    "onnxruntime": lambda data, spec, manifest: OnnxRuntimeInference(
        data, spec, manifest.input.image_size),
    "eager": lambda data, spec, manifest: EagerInference(data, spec, manifest),
}


def load_inference(manifest_path: str | Path, prefer: Sequence[str] = INFERENCE_RUNTIMES,
                   expected_manifest_sha256: str | None = None,
                   kind: str = "inference") -> InferenceRuntime:
    """Verified inference runtime for a bundle; ``.run(x)`` maps NCHW float32 to outputs.

    ``kind``: "inference" (images -> features or logits) or "trunk" (images -> the
    activations a tail_training program takes). The returned object also has ``runtime``
    (its name) and ``manifest`` (input size, normalisation, output kind) attributes.
    """
    if kind not in ("inference", "trunk"):
        raise ValueError(f"kind must be 'inference' or 'trunk', got {kind!r}")
    manifest = load_manifest(manifest_path, expected_manifest_sha256)
    runtime = open_first_available(manifest, kind, prefer, INFERENCE_BACKENDS)
    runtime.manifest = manifest
    return runtime
