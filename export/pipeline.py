"""Build a deployable bundle: backbone + task -> runtime artifacts + manifest, or nothing.

Steps: build the frozen backbone (pretrained or given weights) and the head; lower the
inference model for each requested runtime (XNNPACK-delegated ``.pte``, ``.onnx``, eager
state dict) and the head's training program (``.pte``, plus an eager state dict); load
every artifact *in its runtime* (the same classes devices use) and compare it with eager
torch on real images (inference) or with torch autograd and ``torch.optim.SGD``
(training); then write the files and a manifest with the measured errors. If any error
exceeds its tolerance, :class:`ParityError` is raised and nothing is written.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import math
import platform
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from edge_client.models import BACKBONES, build_backbone, weights_sha256
from edge_client.models.preprocess import to_model_input
from edge_client.runtime.base import check_parameter_dict
from edge_client.runtime.eager_runtime import state_dict_to_bytes, torch_version
from edge_client.runtime.executorch_runtime import executorch_version
from edge_client.runtime.inference import INFERENCE_BACKENDS
from edge_client.runtime.manifest import (
    ArtifactSpec,
    BatchSpec,
    InputNormalisation,
    Manifest,
    TensorSpec,
)
from edge_client.runtime.onnx_runtime import onnxruntime_version
from edge_client.runtime.program_modules import InferenceModel, TemperatureScaledHead
from edge_client.runtime.training import TRAINING_BACKENDS, TrainingSession
from edge_client.runtime.verification import file_sha256
from export.executorch_export import lower_inference_program
from export.manifest import describe_artifact, write_bundle
from export.onnx_export import export_onnx_model
from export.parity import (
    ParityImages,
    inference_parity,
    load_parity_images,
    training_parity,
)
from export.training_program import lower_training_program

__all__ = [
    "DEFAULT_INFERENCE_RUNTIMES",
    "ExportError",
    "ParityError",
    "export_bundle",
]

logger = logging.getLogger(__name__)

DEFAULT_INFERENCE_RUNTIMES = ("executorch", "onnxruntime", "eager")
DEFAULT_TRAINING_RUNTIMES = ("executorch", "eager")


class ExportError(RuntimeError):
    """The export request cannot be fulfilled (bad arguments, unusable weights, ...)."""


class ParityError(ExportError):
    """An artifact disagrees with eager torch beyond tolerance; no bundle was written."""

    def __init__(self, failures: list[str], measurements: dict[str, dict]):
        self.failures = failures
        self.measurements = measurements
        super().__init__("export refused, no artifact written: " + "; ".join(failures))


@dataclasses.dataclass
class _Artifact:
    spec: ArtifactSpec
    data: bytes


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("fedfleet", "executorch", "onnx", "onnxruntime", "onnxscript"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def _load_backbone(name: str, weights: Path | None):
    if name not in BACKBONES:
        raise ExportError(f"unknown backbone {name!r}; choose one of {list(BACKBONES)}")
    if weights is None:
        return build_backbone(name, pretrained=True), weights_sha256(name)
    with torch.random.fork_rng():
        backbone = build_backbone(name, pretrained=False)
    try:
        state_dict = torch.load(weights, map_location="cpu", weights_only=True)
        backbone.load_state_dict(state_dict, strict=True)
    except (OSError, RuntimeError, KeyError, TypeError) as error:
        raise ExportError(f"cannot load {name} weights from {weights}: {error}") from error
    return backbone.eval(), file_sha256(weights)


def _load_head(path: Path | None, num_classes: int, feature_dim: int) -> dict[str, np.ndarray]:
    shapes = {"weight": (num_classes, feature_dim), "bias": (num_classes,)}
    if path is None:
        return {name: np.zeros(shape, dtype=np.float32) for name, shape in shapes.items()}
    try:
        with np.load(path, allow_pickle=False) as archive:
            params = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as error:
        raise ExportError(f"cannot read head weights {path}: {error}") from error
    try:
        return check_parameter_dict(params, shapes)
    except (TypeError, ValueError) as error:
        raise ExportError(f"head weights {path}: {error}") from error


def _check_arguments(num_classes, image_size, temperature, batch_size, inference_runtimes,
                     tolerance, gradient_tolerance) -> None:
    def positive_int(value, what):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ExportError(f"{what} must be a positive integer, got {value!r}")

    positive_int(num_classes, "num_classes")
    positive_int(image_size, "image_size")
    positive_int(batch_size, "batch_size")
    if image_size < 32:
        raise ExportError(f"image_size must be >= 32 (five stride-2 stages), got {image_size}")
    for value, what in ((temperature, "temperature"), (tolerance, "tolerance"),
                        (gradient_tolerance, "gradient_tolerance")):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ExportError(f"{what} must be a positive finite number, got {value!r}")
    unknown = set(inference_runtimes) - set(DEFAULT_INFERENCE_RUNTIMES)
    if unknown or len(set(inference_runtimes)) != len(inference_runtimes):
        raise ExportError(
            f"inference runtimes must be distinct names from {list(DEFAULT_INFERENCE_RUNTIMES)}, "
            f"got {list(inference_runtimes)}")


def export_bundle(backbone: str, out_dir: str | Path, *, num_classes: int, image_size: int = 224,
                  weights: str | Path | None = None, head_weights: str | Path | None = None,
                  full_model: bool = False, temperature: float = 0.1, batch_size: int = 32,
                  inference_runtimes: Sequence[str] = DEFAULT_INFERENCE_RUNTIMES,
                  training: bool = True, parity_images: ParityImages | None = None,
                  tolerance: float = 1e-4, gradient_tolerance: float = 1e-5,
                  overwrite: bool = False) -> Path:
    """Export ``backbone`` for a ``num_classes`` task to ``out_dir``; returns the manifest path.

    ``full_model``: inference artifacts return logits of the head (``head_weights``, an
    ``.npz`` with ``weight`` (C, d) and ``bias`` (C,), is then required); otherwise they
    return the pooled features. ``head_weights`` also initialises the training program
    (zeros otherwise; devices normally ``set_parameters`` from the Fed3R solution).
    ``batch_size``: the ExecuTorch inference bound and the training program's fixed batch.
    """
    inference_runtimes = tuple(inference_runtimes)
    _check_arguments(num_classes, image_size, temperature, batch_size, inference_runtimes,
                     tolerance, gradient_tolerance)
    if not inference_runtimes and not training:
        raise ExportError("nothing to export: no inference runtime and no training program")
    if full_model and head_weights is None:
        raise ExportError("a full model (logits) needs head weights (--head-weights file.npz)")

    backbone_module, backbone_digest = _load_backbone(
        backbone, None if weights is None else Path(weights))
    feature_dim = int(backbone_module.feature_dim)
    head = _load_head(None if head_weights is None else Path(head_weights), num_classes, feature_dim)
    model = InferenceModel(backbone_module, num_classes if full_model else None, feature_dim)
    if full_model:
        model.head.weight.data.copy_(torch.from_numpy(head["weight"]))
        model.head.bias.data.copy_(torch.from_numpy(head["bias"]))

    parity_images = parity_images or load_parity_images()
    inputs = to_model_input(parity_images.images, image_size, backbone_module.mean,
                            backbone_module.std)
    with torch.no_grad():
        input_tensor = torch.from_numpy(inputs)
        features = backbone_module(input_tensor).numpy()
        reference = model(input_tensor).numpy()

    draft = Manifest(
        backbone=backbone, weights_sha256=backbone_digest, feature_dim=feature_dim,
        num_classes=num_classes, temperature=float(temperature),
        output="logits" if full_model else "features",
        input=InputNormalisation(image_size=image_size, mean=tuple(backbone_module.mean),
                                 std=tuple(backbone_module.std)),
        artifacts=(), created_with=_versions())

    artifacts: list[_Artifact] = []
    failures: list[str] = []
    for runtime in inference_runtimes:
        logger.info("exporting %s inference artifact for %s", runtime, backbone)
        artifact = _inference_artifact(runtime, model, input_tensor, draft, batch_size)
        runtime_object = INFERENCE_BACKENDS[runtime](artifact.data, artifact.spec, draft)
        error = inference_parity(runtime_object, inputs, reference)
        artifact.spec = dataclasses.replace(artifact.spec, parity={
            "max_abs_error": error, "tolerance": tolerance, "reference": "eager torch",
            "inputs": parity_images.source})
        if not error <= tolerance:
            failures.append(f"{artifact.spec.file}: max abs error {error:.3g} vs eager "
                            f"exceeds tolerance {tolerance:g}")
        artifacts.append(artifact)

    if training:
        rows = min(len(features), batch_size + max(1, batch_size // 4))  # a full + a padded chunk
        labels = (parity_images.labels[:rows] if parity_images.labels is not None
                  else np.arange(rows)) % num_classes
        for runtime in DEFAULT_TRAINING_RUNTIMES:
            logger.info("exporting %s training artifact", runtime)
            artifact = _training_artifact(runtime, head, draft, batch_size)
            trainer = TRAINING_BACKENDS[runtime](artifact.data, artifact.spec, draft)
            session = TrainingSession(trainer, artifact.spec, draft)
            measured = training_parity(session, features[:rows], labels.astype(np.int64),
                                       temperature)
            artifact.spec = dataclasses.replace(artifact.spec, parity={
                **measured.to_json(), "tolerance": gradient_tolerance,
                "reference": "torch autograd + torch.optim.SGD",
                "inputs": f"eager features of {parity_images.source}"})
            worst = max(measured.gradient_max_abs_error, measured.sgd_max_abs_error)
            if not worst <= gradient_tolerance:
                failures.append(
                    f"{artifact.spec.file}: gradient error {measured.gradient_max_abs_error:.3g}"
                    f" / SGD error {measured.sgd_max_abs_error:.3g} exceed {gradient_tolerance:g}")
            artifacts.append(artifact)

    if failures:
        raise ParityError(failures, {a.spec.file: dict(a.spec.parity) for a in artifacts})
    manifest = dataclasses.replace(draft, artifacts=tuple(a.spec for a in artifacts))
    return write_bundle(out_dir, manifest, {a.spec.file: a.data for a in artifacts}, overwrite)


def _image_spec(draft: Manifest) -> tuple[TensorSpec, ...]:
    size = draft.input.image_size
    return (TensorSpec(draft.input.name, "float32", (None, 3, size, size)),)


def _output_spec(draft: Manifest) -> tuple[TensorSpec, ...]:
    width = draft.feature_dim if draft.output == "features" else draft.num_classes
    return (TensorSpec(draft.output, "float32", (None, width)),)


def _inference_artifact(runtime: str, model: InferenceModel, example: torch.Tensor,
                        draft: Manifest, batch_size: int) -> _Artifact:
    max_batch = None  # ONNX and eager take any batch
    if runtime == "executorch":
        program = lower_inference_program(model, example, batch_size)
        data, file, version, max_batch = (program.buffer, "inference_xnnpack.pte",
                                          executorch_version(), batch_size)
        details = {"method": "forward", "delegate": "xnnpack",
                   "delegate_calls": program.delegate_calls, "portable_ops": program.portable_ops}
    elif runtime == "onnxruntime":
        onnx_model = export_onnx_model(model, example, draft.input.name, draft.output)
        data, file, version = onnx_model.buffer, "inference.onnx", onnxruntime_version()
        details = {"opset": onnx_model.opset, "ir_version": onnx_model.ir_version,
                   "execution_provider": "CPUExecutionProvider"}
    else:
        data, file, version = (state_dict_to_bytes(model.state_dict()), "inference_eager.pt",
                               torch_version())
        details = {"format": "torch.save state dict (weights_only)",
                   "module": "edge_client.runtime.program_modules.InferenceModel"}
    spec = describe_artifact("inference", runtime, version, file, data, BatchSpec(max=max_batch),
                             _image_spec(draft), _output_spec(draft), details)
    return _Artifact(spec, data)


def _training_artifact(runtime: str, head: dict[str, np.ndarray], draft: Manifest,
                       batch_size: int) -> _Artifact:
    module = TemperatureScaledHead(draft.feature_dim, draft.num_classes, draft.temperature)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(head["weight"]))
        module.bias.copy_(torch.from_numpy(head["bias"]))
    details = {
        "method": "forward",
        "trainable_parameters": {"weight": [draft.num_classes, draft.feature_dim],
                                 "bias": [draft.num_classes]},
        "loss": {"type": "temperature_scaled_cross_entropy", "temperature": draft.temperature,
                 "formula": "sum_i w_i * CE(logits_i / T, y_i) / sum_i w_i"},
        "optimizer": {"type": "sgd", "applied_by": "runtime", "momentum": 0.0,
                      "weight_decay": 0.0},
        "padding": "rows past the real ones are zeros with sample_weight 0",
        "frozen": "the backbone, BatchNorm included, is not part of the program",
    }
    if runtime == "executorch":
        data, file, version = (lower_training_program(module, batch_size), "head_training.pte",
                               executorch_version())
    else:
        data, file, version = (state_dict_to_bytes(module.state_dict()), "head_training_eager.pt",
                               torch_version())
        details["format"] = "torch.save state dict (weights_only)"
    d, c, b = draft.feature_dim, draft.num_classes, batch_size
    inputs = (TensorSpec("features", "float32", (b, d)), TensorSpec("labels", "int64", (b,)),
              TensorSpec("sample_weight", "float32", (b,)))
    outputs = (TensorSpec("loss", "float32", ()), TensorSpec("logits", "float32", (b, c)))
    spec = describe_artifact("training", runtime, version, file, data,
                             BatchSpec(max=batch_size, fixed=True), inputs, outputs, details)
    return _Artifact(spec, data)
