"""Build a deployable bundle: backbone + task -> runtime artifacts + manifest, or nothing.

Steps: build the frozen backbone (pretrained or given weights) and the head; lower the
inference model for each requested runtime (XNNPACK-delegated ``.pte``, ``.onnx``, eager
state dict) and the head's training program (``.pte``, plus an eager state dict); load
every artifact *in its runtime* (the same classes devices use) and compare it with eager
torch on real images (inference) or with torch autograd and ``torch.optim.SGD``
(training); then write the files and a manifest with the measured errors. If any error
exceeds its tolerance, :class:`ParityError` is raised and nothing is written.

With ``quantize="int8"`` the ExecuTorch inference program (only that one: ONNX, eager, trunk
and training programs stay fp32) is statically quantized for XNNPACK's int8 kernels
(:mod:`export.quantization`), calibrated on real images other than the parity images, and
checked against eager fp32 with int8-appropriate metrics and tolerance
(:data:`INT8_RELATIVE_ERROR_TOLERANCE`).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import logging
import math
import platform
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from edge_client.runtime.auto import REFERENCE_KEY, calibration_input, encode_reference
from edge_client.models import BACKBONES, build_backbone, weights_sha256
from edge_client.models.preprocess import to_model_input
from edge_client.models.tail import TailModel, split_backbone
from edge_client.runtime.base import check_parameter_dict
from edge_client.runtime.eager_runtime import state_dict_to_bytes, torch_version
from edge_client.runtime.executorch_runtime import executorch_version
from edge_client.runtime.inference import INFERENCE_BACKENDS
from protocols.bundle_manifest import (
    ArtifactSpec,
    BatchSpec,
    InputNormalisation,
    Manifest,
    TailSpec,
    TensorSpec,
)
from edge_client.runtime.onnx_runtime import onnxruntime_version
from edge_client.runtime.program_modules import (
    InferenceModel,
    TailClassifier,
    TemperatureScaledHead,
    TrunkModel,
)
from edge_client.runtime.training import TRAINING_BACKENDS, TrainingSession
from edge_client.runtime.verification import file_sha256
from export.executorch_export import lower_inference_program
from export.manifest import describe_artifact, write_bundle
from export.onnx_export import export_onnx_model
from export.parity import (
    ParityImages,
    inference_parity,
    load_calibration_images,
    load_parity_images,
    training_parity,
)
from export.quantization import INT8_SCHEME, QUANTIZATION_MODES, quantize_int8, quantized_parity
from export.training_program import lower_training_program

__all__ = [
    "DEFAULT_INFERENCE_RUNTIMES",
    "INT8_RELATIVE_ERROR_TOLERANCE",
    "ExportError",
    "ParityError",
    "export_bundle",
]

logger = logging.getLogger(__name__)

DEFAULT_INFERENCE_RUNTIMES = ("executorch", "onnxruntime", "eager")
DEFAULT_TRAINING_RUNTIMES = ("executorch", "eager")
# SGD step size of the training parity check. The tail program uses a smaller one: with T = 0.1
# its pretrained conv weights get large gradients, and at 0.05 three steps amplify the chunked
# float sums (1e-6) to 1e-4; fine-tuning LRs are far below either.
PARITY_LR = 0.05
TAIL_PARITY_LR = 0.005
# Largest relative L2 error ||Q - F|| / ||F|| of an int8 program's outputs vs eager fp32 on the
# parity images. With export.quantization's scheme, on 64 Fashion-MNIST test images, both
# backbones measured 0.17-0.18 at 32-64 px and 0.25-0.26 at 128-224 px; the same scheme without
# the conv+ReLU6 fusion 0.34-0.39, and calibration on black images 0.70. What int8 costs in
# accuracy is measured by bench/quantization.py.
INT8_RELATIVE_ERROR_TOLERANCE = 0.3


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
                     tolerance, gradient_tolerance, tail_stages, quantize,
                     quantized_tolerance) -> None:
    def positive_int(value, what):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ExportError(f"{what} must be a positive integer, got {value!r}")

    positive_int(num_classes, "num_classes")
    positive_int(image_size, "image_size")
    positive_int(batch_size, "batch_size")
    if isinstance(tail_stages, bool) or not isinstance(tail_stages, int) or tail_stages < 0:
        raise ExportError(f"tail_stages must be an integer >= 0, got {tail_stages!r}")
    if image_size < 32:
        raise ExportError(f"image_size must be >= 32 (five stride-2 stages), got {image_size}")
    for value, what in ((temperature, "temperature"), (tolerance, "tolerance"),
                        (gradient_tolerance, "gradient_tolerance"),
                        (quantized_tolerance, "quantized_tolerance")):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ExportError(f"{what} must be a positive finite number, got {value!r}")
    unknown = set(inference_runtimes) - set(DEFAULT_INFERENCE_RUNTIMES)
    if unknown or len(set(inference_runtimes)) != len(inference_runtimes):
        raise ExportError(
            f"inference runtimes must be distinct names from {list(DEFAULT_INFERENCE_RUNTIMES)}, "
            f"got {list(inference_runtimes)}")
    if quantize is not None and quantize not in QUANTIZATION_MODES:
        raise ExportError(f"quantize must be None or one of {list(QUANTIZATION_MODES)}, "
                          f"got {quantize!r}")
    if quantize is not None and "executorch" not in inference_runtimes:
        raise ExportError(f"{quantize} quantization applies to the ExecuTorch inference program: "
                          "add executorch to the inference runtimes")


def export_bundle(backbone: str, out_dir: str | Path, *, num_classes: int, image_size: int = 224,
                  weights: str | Path | None = None, head_weights: str | Path | None = None,
                  full_model: bool = False, temperature: float = 0.1, batch_size: int = 32,
                  inference_runtimes: Sequence[str] = DEFAULT_INFERENCE_RUNTIMES,
                  training: bool = True, parity_images: ParityImages | None = None,
                  tolerance: float = 1e-4, gradient_tolerance: float = 1e-5,
                  tail_stages: int = 0, overwrite: bool = False, quantize: str | None = None,
                  calibration_images: ParityImages | None = None,
                  quantized_tolerance: float = INT8_RELATIVE_ERROR_TOLERANCE) -> Path:
    """Export ``backbone`` for a ``num_classes`` task to ``out_dir``; returns the manifest path.

    ``full_model``: inference artifacts return logits of the head (``head_weights``, an
    ``.npz`` with ``weight`` (C, d) and ``bias`` (C,), is then required); otherwise they
    return the pooled features. ``head_weights`` also initialises the training program
    (zeros otherwise; devices normally ``set_parameters`` from the Fed3R solution).
    ``batch_size``: the ExecuTorch inference bound and the training program's fixed batch.
    ``tail_stages`` > 0 adds what FT(φ)/FT(M) need (``edge_client.models.tail``): trunk
    programs (images -> activations before the last ``tail_stages`` stages) for the same
    inference runtimes, and tail_training programs (tail + head, BatchNorm frozen).
    ``quantize="int8"``: the ExecuTorch inference program is int8 (``inference_xnnpack_int8.pte``),
    calibrated on ``calibration_images`` (default: Fashion-MNIST train images) and refused
    unless its relative L2 error vs eager fp32 on the parity images is <= ``quantized_tolerance``.
    """
    inference_runtimes = tuple(inference_runtimes)
    _check_arguments(num_classes, image_size, temperature, batch_size, inference_runtimes,
                     tolerance, gradient_tolerance, tail_stages, quantize, quantized_tolerance)
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
    if quantize is not None:
        calibration_images = calibration_images or load_calibration_images()
    inputs = to_model_input(parity_images.images, image_size, backbone_module.mean,
                            backbone_module.std)
    with torch.no_grad():
        input_tensor = torch.from_numpy(inputs)
        features = backbone_module(input_tensor).numpy()
        reference = model(input_tensor).numpy()
    tail_spec = trunk = tail = None
    if tail_stages:
        try:
            trunk, tail = split_backbone(backbone_module, tail_stages)
        except ValueError as error:
            raise ExportError(str(error)) from error
        with torch.no_grad():
            activations = trunk(input_tensor).numpy()
        tail_spec = TailSpec(stages=tail_stages, activation_shape=tuple(activations.shape[1:]),
                             parameters={f"tail.{name}": tuple(param.shape)
                                         for name, param in tail.named_parameters()})

    draft = Manifest(
        backbone=backbone, weights_sha256=backbone_digest, feature_dim=feature_dim,
        num_classes=num_classes, temperature=float(temperature),
        output="logits" if full_model else "features",
        input=InputNormalisation(image_size=image_size, mean=tuple(backbone_module.mean),
                                 std=tuple(backbone_module.std)),
        artifacts=(), created_with=_versions(), tail=tail_spec,
        feature_range=getattr(backbone_module, "feature_range", None))

    artifacts: list[_Artifact] = []
    failures: list[str] = []
    programs = [("inference", model, reference)]
    if trunk is not None:
        programs.append(("trunk", TrunkModel(trunk), activations))
    for kind, module, expected in programs:
        for runtime in inference_runtimes:
            quantized = kind == "inference" and runtime == "executorch" and quantize is not None
            logger.info("exporting %s %s%s artifact for %s", runtime, kind,
                        f" ({quantize})" if quantized else "", backbone)
            artifact = _inference_artifact(runtime, kind, module, input_tensor, draft, batch_size,
                                           calibration_images if quantized else None)
            runtime_object = INFERENCE_BACKENDS[runtime](artifact.data, artifact.spec, draft)
            if quantized:
                measured = quantized_parity(runtime_object.run(inputs), expected)
                artifact.spec = dataclasses.replace(artifact.spec, parity={
                    **measured.to_json(), "tolerance": quantized_tolerance,
                    "tolerance_metric": "relative_l2_error", "reference": "eager torch (fp32)",
                    "inputs": parity_images.source})
                if not measured.relative_l2_error <= quantized_tolerance:
                    failures.append(
                        f"{artifact.spec.file}: relative L2 error {measured.relative_l2_error:.3g} "
                        f"vs eager fp32 exceeds tolerance {quantized_tolerance:g}")
            else:
                error = inference_parity(runtime_object, inputs, expected)
                artifact.spec = dataclasses.replace(artifact.spec, parity={
                    "max_abs_error": error, "tolerance": tolerance, "reference": "eager torch",
                    "inputs": parity_images.source})
                if not error <= tolerance:
                    failures.append(f"{artifact.spec.file}: max abs error {error:.3g} vs eager "
                                    f"exceeds tolerance {tolerance:g}")
            artifacts.append(artifact)
    _record_reference(artifacts, model, draft)

    if tail is not None:
        logger.info("exporting the server's tail evaluation program")
        artifact, error = _tail_eval_artifact(tail, head, activations, draft)
        artifact.spec = dataclasses.replace(artifact.spec, parity={
            "max_abs_error": error, "tolerance": tolerance, "reference": "eager torch",
            "inputs": f"eager trunk activations of {parity_images.source}"})
        if not error <= tolerance:
            failures.append(f"{artifact.spec.file}: max abs error {error:.3g} vs eager "
                            f"exceeds tolerance {tolerance:g}")
        artifacts.append(artifact)

    if training:
        rows = min(len(features), batch_size + max(1, batch_size // 4))  # a full + a padded chunk
        labels = (parity_images.labels[:rows] if parity_images.labels is not None
                  else np.arange(rows)) % num_classes
        trainables = [(None, features)]
        if tail is not None:
            trainables.append((tail, activations))
        for program_tail, program_inputs in trainables:
            for runtime in DEFAULT_TRAINING_RUNTIMES:
                logger.info("exporting %s %straining artifact", runtime,
                            "" if program_tail is None else "tail ")
                artifact = _training_artifact(runtime, head, draft, batch_size, program_tail)
                trainer = TRAINING_BACKENDS[runtime](artifact.data, artifact.spec, draft)
                session = TrainingSession(trainer, artifact.spec, draft)
                measured = training_parity(session, program_inputs[:rows], labels.astype(np.int64),
                                           temperature, tail=copy.deepcopy(program_tail),
                                           lr=PARITY_LR if program_tail is None else TAIL_PARITY_LR)
                artifact.spec = dataclasses.replace(artifact.spec, parity={
                    **measured.to_json(), "tolerance": gradient_tolerance,
                    "reference": "torch autograd + torch.optim.SGD",
                    "inputs": f"eager {'features' if program_tail is None else 'trunk activations'}"
                              f" of {parity_images.source}"})
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


def _record_reference(artifacts: list[_Artifact], model: torch.nn.Module, draft: Manifest) -> None:
    """Eager fp32 outputs on fixed images, in the first inference artifact's details: a device without
    torch checks its runtimes' parity against them (``edge_client.runtime.auto``, ``--runtime auto``)."""
    first = next((a for a in artifacts if a.spec.kind == "inference"), None)
    if first is None:
        return
    with torch.no_grad():
        outputs = model(torch.from_numpy(calibration_input(draft))).numpy()
    first.spec = dataclasses.replace(first.spec, details={**first.spec.details, REFERENCE_KEY: encode_reference(outputs)})


def _image_spec(draft: Manifest) -> tuple[TensorSpec, ...]:
    size = draft.input.image_size
    return (TensorSpec(draft.input.name, "float32", (None, 3, size, size)),)


def _output_spec(draft: Manifest, kind: str) -> tuple[TensorSpec, ...]:
    if kind == "trunk":
        return (TensorSpec("activations", "float32", (None, *draft.tail.activation_shape)),)
    width = draft.feature_dim if draft.output == "features" else draft.num_classes
    return (TensorSpec(draft.output, "float32", (None, width)),)


def _inference_artifact(runtime: str, kind: str, model: torch.nn.Module, example: torch.Tensor,
                        draft: Manifest, batch_size: int,
                        calibration: ParityImages | None = None) -> _Artifact:
    """``kind`` "inference" (``InferenceModel``) or "trunk" (``TrunkModel``); with
    ``calibration`` (ExecuTorch only) the program is int8, calibrated on those images."""
    max_batch = None  # ONNX and eager take any batch
    output_spec = _output_spec(draft, kind)
    if runtime == "executorch":
        suffix, quantization = "", None
        if calibration is not None:
            calibration_inputs = torch.from_numpy(to_model_input(
                calibration.images, draft.input.image_size, draft.input.mean, draft.input.std))
            model = quantize_int8(model, example, calibration_inputs, batch_size)
            suffix, quantization = "_int8", {
                "mode": "int8", "scheme": INT8_SCHEME,
                "calibration_images": len(calibration_inputs),
                "calibration_inputs": calibration.source}
        program = lower_inference_program(model, example, batch_size)
        data, file, version, max_batch = (program.buffer, f"{kind}_xnnpack{suffix}.pte",
                                          executorch_version(), batch_size)
        details = {"method": "forward", "delegate": "xnnpack",
                   "delegate_calls": program.delegate_calls, "portable_ops": program.portable_ops}
        if quantization is not None:
            details["quantization"] = quantization
    elif runtime == "onnxruntime":
        onnx_model = export_onnx_model(model, example, draft.input.name, output_spec[0].name)
        data, file, version = onnx_model.buffer, f"{kind}.onnx", onnxruntime_version()
        details = {"opset": onnx_model.opset, "ir_version": onnx_model.ir_version,
                   "execution_provider": "CPUExecutionProvider"}
    else:
        data, file, version = (state_dict_to_bytes(model.state_dict()), f"{kind}_eager.pt",
                               torch_version())
        details = {"format": "torch.save state dict (weights_only)",
                   "module": f"edge_client.runtime.program_modules.{type(model).__name__}"}
    spec = describe_artifact(kind, runtime, version, file, data, BatchSpec(max=max_batch),
                             _image_spec(draft), output_spec, details)
    return _Artifact(spec, data)


def _tail_eval_artifact(tail: TailModel, head: dict[str, np.ndarray], activations: np.ndarray,
                        draft: Manifest) -> tuple[_Artifact, float]:
    """The server's FT(φ)/FT(M) evaluation program: ``torch.export`` of :class:`TailClassifier`
    (any batch), saved as a ``.pt2``; parity = its logits vs the eager module's, with the
    parameters passed in by name as the server will (``torch.func.functional_call``)."""
    import io

    module = TailClassifier(copy.deepcopy(tail), draft.feature_dim, draft.num_classes).eval()
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(head["weight"]))
        module.bias.copy_(torch.from_numpy(head["bias"]))
    example = torch.from_numpy(activations[:2].copy())
    exported = torch.export.export(module, (example,), dynamic_shapes=(
        {0: torch.export.Dim("batch", min=1, max=1 << 20)},))
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    data = buffer.getvalue()
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    rng = np.random.default_rng(1)
    probe = {name: torch.from_numpy(param.detach().numpy() + rng.normal(
        0.0, 0.01, tuple(param.shape)).astype(np.float32)) for name, param in module.named_parameters()}
    inputs = torch.from_numpy(activations)
    with torch.no_grad():
        error = float((torch.func.functional_call(loaded, probe, (inputs,))
                       - torch.func.functional_call(module, probe, (inputs,))).abs().max())
    parameters = {name: list(param.shape) for name, param in module.named_parameters()}
    spec = describe_artifact(
        "tail_eval", "eager", torch_version(), "tail_eval.pt2", data, BatchSpec(max=None),
        (TensorSpec("activations", "float32", (None, *draft.tail.activation_shape)),),
        (TensorSpec("logits", "float32", (None, draft.num_classes)),),
        {"format": "torch.export ExportedProgram (torch.export.save)",
         "parameters": parameters,
         "use": "the aggregator loads it with torch.export.load and evaluates a global model by "
                "passing its tensors by name (torch.func.functional_call)"})
    return _Artifact(spec, data), error


def _training_artifact(runtime: str, head: dict[str, np.ndarray], draft: Manifest,
                       batch_size: int, tail: TailModel | None = None) -> _Artifact:
    """The head's training program, or with ``tail`` the tail + head program (kind
    tail_training), both initialised with ``head`` (and the tail's pretrained weights)."""
    module = TemperatureScaledHead(draft.feature_dim, draft.num_classes, draft.temperature,
                                   None if tail is None else copy.deepcopy(tail))
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(head["weight"]))
        module.bias.copy_(torch.from_numpy(head["bias"]))
    kind = "training" if tail is None else "tail_training"
    trainable = {name: list(shape) for name, shape in draft.head_parameter_shapes().items()}
    if tail is not None:
        trainable = {**{name: list(shape) for name, shape in draft.tail.parameters.items()},
                     **trainable}
    details = {
        "method": "forward",
        "trainable_parameters": trainable,
        "loss": {"type": "temperature_scaled_cross_entropy", "temperature": draft.temperature,
                 "formula": "sum_i w_i * CE(logits_i / T, y_i) / sum_i w_i"},
        "optimizer": {"type": "sgd", "applied_by": "runtime", "momentum": 0.0,
                      "weight_decay": 0.0},
        "padding": "rows past the real ones are zeros with sample_weight 0",
        "frozen": ("the backbone, BatchNorm included, is not part of the program" if tail is None
                   else f"the trunk is not part of the program; the last {draft.tail.stages} "
                        "stages are, with BatchNorm frozen into per-channel scale/shift buffers"),
    }
    stem = "head_training" if tail is None else "tail_training"
    if runtime == "executorch":
        input_shape = None if tail is None else draft.tail.activation_shape
        data, file, version = (lower_training_program(module, batch_size, input_shape),
                               f"{stem}.pte", executorch_version())
    else:
        data, file, version = (state_dict_to_bytes(module.state_dict()), f"{stem}_eager.pt",
                               torch_version())
        details["format"] = "torch.save state dict (weights_only)"
    c, b = draft.num_classes, batch_size
    first = (TensorSpec("features", "float32", (b, draft.feature_dim)) if tail is None else
             TensorSpec("activations", "float32", (b, *draft.tail.activation_shape)))
    inputs = (first, TensorSpec("labels", "int64", (b,)),
              TensorSpec("sample_weight", "float32", (b,)))
    outputs = (TensorSpec("loss", "float32", ()), TensorSpec("logits", "float32", (b, c)))
    spec = describe_artifact(kind, runtime, version, file, data,
                             BatchSpec(max=batch_size, fixed=True), inputs, outputs, details)
    return _Artifact(spec, data)
