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
import hashlib
import importlib.metadata
import io
import logging
import platform
from pathlib import Path

import numpy as np
import torch

from edge_client.runtime.auto import REFERENCE_KEY, calibration_input, encode_reference
from edge_client.models import BACKBONES, build_backbone, pretrained_backbone
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
from export.batch_norm_folding import fold_batch_norms
from export.executorch_export import lower_inference_program
from export.manifest import describe_artifact, write_bundle
from export.onnx_export import export_onnx_model
from export.parity import (
    ParityImages,
    inference_parity,
    load_calibration_images,
    load_parity_images,
    run_for_parity,
    training_parity,
    worst_error,
)
from export.quantization import INT8_SCHEME, QuantizedParity, quantize_int8, quantized_parity
from export.request import (
    DEFAULT_INFERENCE_RUNTIMES,
    INT8_MIN_ROW_COSINE,
    INT8_RELATIVE_ERROR_TOLERANCE,
    ExportError,
    ExportRequest,
)
from export.training_program import lower_training_program
from protocols.files import read_npz
from protocols.regular_file import read_regular_file

MAX_HEAD_FILE_BYTES = 1 << 30      # a head's weights (100,000 classes of 1,280 float32 features: 0.5 GB)
# a backbone's state dict (--weights): 14 MB (MobileNetV2) to 19 MB (EfficientNet-Lite0) of float32,
# with room for float64 tensors and torch's zip padding
MAX_WEIGHTS_FILE_BYTES = 256 << 20

__all__ = [
    "DEFAULT_INFERENCE_RUNTIMES",
    "INT8_MIN_ROW_COSINE",
    "INT8_RELATIVE_ERROR_TOLERANCE",
    "ExportError",
    "ExportRequest",
    "ParityError",
    "export_bundle",
]

logger = logging.getLogger(__name__)

DEFAULT_TRAINING_RUNTIMES = ("executorch", "eager")
# SGD step size of the training parity check. The tail program uses a smaller one: with T = 0.1
# its pretrained conv weights get large gradients, and at 0.05 three steps amplify the chunked
# float sums (1e-6) to 1e-4; fine-tuning LRs are far below either.
PARITY_LR = 0.05
TAIL_PARITY_LR = 0.005
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
    if weights is None:     # the weights file read once: loaded and hashed from the same bytes
        return pretrained_backbone(name)
    # read once, bounded, never blocking on a FIFO: the digest recorded (devices and feature caches
    # are keyed on it) is that of the bytes loaded, not of a second read of a file changed meanwhile
    try:
        data = read_regular_file(weights, f"{name} weights", MAX_WEIGHTS_FILE_BYTES)
    except ValueError as error:
        raise ExportError(f"cannot read {name} weights: {error}") from error
    with torch.random.fork_rng():
        backbone = build_backbone(name, pretrained=False)
    try:
        state_dict = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        backbone.load_state_dict(state_dict, strict=True)
    except Exception as error:      # noqa: BLE001 - torch's unpickler fails many ways (IndexError on a non-torch file)
        raise ExportError(f"cannot load {name} weights from {weights}: {type(error).__name__}: {error}") from error
    return backbone.eval(), hashlib.sha256(data).hexdigest()


def _load_head(path: Path | None, num_classes: int, feature_dim: int) -> dict[str, np.ndarray]:
    shapes = {"weight": (num_classes, feature_dim), "bias": (num_classes,)}
    if path is None:
        return {name: np.zeros(shape, dtype=np.float32) for name, shape in shapes.items()}
    try:     # bounded before anything is inflated (an .npz header may declare any shape)
        params = read_npz(read_regular_file(path, "head weights", MAX_HEAD_FILE_BYTES), max_bytes=MAX_HEAD_FILE_BYTES)
    except (OSError, ValueError) as error:
        raise ExportError(f"cannot read head weights {path}: {error}") from error
    try:
        return check_parameter_dict(params, shapes)
    except (TypeError, ValueError) as error:
        raise ExportError(f"head weights {path}: {error}") from error


def export_bundle(backbone: str, out_dir: str | Path, **options) -> Path:
    """Export ``backbone`` to ``out_dir`` as :class:`ExportRequest` ``options`` say (``num_classes``
    required); returns the manifest path. Every artifact is checked in its runtime against eager
    torch first: a failure raises :class:`ParityError` and writes nothing."""
    request = ExportRequest(backbone, out_dir, **options)
    sources = _Sources.build(request)
    failures: list[str] = []
    artifacts = _inference_artifacts(request, sources, failures)
    _record_reference(artifacts, sources.model, sources.draft)
    if sources.tail is not None:
        artifacts.append(_checked_tail_eval(request, sources, failures))
    if request.training:
        artifacts += _training_artifacts(request, sources, failures)
    if failures:
        raise ParityError(failures, {a.spec.file: dict(a.spec.parity) for a in artifacts})
    manifest = dataclasses.replace(sources.draft, artifacts=tuple(a.spec for a in artifacts))
    return write_bundle(out_dir, manifest, {a.spec.file: a.data for a in artifacts}, request.overwrite)


@dataclasses.dataclass
class _Sources:
    """What every artifact is built from and checked against: the eager modules, the parity
    images (model input), their eager outputs, and the manifest without artifacts."""

    model: torch.nn.Module
    head: dict[str, np.ndarray]
    parity_images: ParityImages
    calibration_images: ParityImages | None
    inputs: np.ndarray
    features: np.ndarray
    reference: np.ndarray
    draft: Manifest
    trunk: torch.nn.Module | None = None
    tail: TailModel | None = None
    activations: np.ndarray | None = None

    @property
    def input_tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.inputs)

    @classmethod
    def build(cls, r: ExportRequest) -> "_Sources":
        backbone, digest = _load_backbone(r.backbone, None if r.weights is None else Path(r.weights))
        feature_dim = int(backbone.feature_dim)
        head = _load_head(None if r.head_weights is None else Path(r.head_weights), r.num_classes, feature_dim)
        model = InferenceModel(backbone, r.num_classes if r.full_model else None, feature_dim)
        if r.full_model:
            model.head.weight.data.copy_(torch.from_numpy(head["weight"]))
            model.head.bias.data.copy_(torch.from_numpy(head["bias"]))
        parity_images = r.parity_images or load_parity_images()
        calibration = (r.calibration_images or load_calibration_images()) if r.quantize is not None else None
        inputs = to_model_input(parity_images.images, r.image_size, backbone.mean, backbone.std)
        with torch.no_grad():
            features = backbone(torch.from_numpy(inputs)).numpy()
            reference = model(torch.from_numpy(inputs)).numpy()
        trunk = tail = activations = tail_spec = None
        if r.tail_stages:
            try:
                trunk, tail = split_backbone(backbone, r.tail_stages)
            except ValueError as error:
                raise ExportError(str(error)) from error
            with torch.no_grad():
                activations = trunk(torch.from_numpy(inputs)).numpy()
            tail_spec = TailSpec(stages=r.tail_stages, activation_shape=tuple(activations.shape[1:]),
                                 parameters={f"tail.{name}": tuple(param.shape)
                                             for name, param in tail.named_parameters()})
        draft = Manifest(
            backbone=r.backbone, weights_sha256=digest, feature_dim=feature_dim,
            num_classes=r.num_classes, temperature=float(r.temperature),
            output="logits" if r.full_model else "features",
            input=InputNormalisation(image_size=r.image_size, mean=tuple(backbone.mean), std=tuple(backbone.std)),
            artifacts=(), created_with=_versions(), tail=tail_spec,
            feature_range=getattr(backbone, "feature_range", None))
        return cls(model, head, parity_images, calibration, inputs, features, reference, draft, trunk, tail,
                   activations)


def _inference_artifacts(r: ExportRequest, src: _Sources, failures: list[str]) -> list[_Artifact]:
    """The inference (and, with a tail, trunk) program per runtime, each run in its runtime on the
    parity images: fp32 within ``tolerance`` (max abs), int8 within ``quantized_tolerance`` (relative L2)."""
    artifacts = []
    programs = [("inference", src.model, src.reference)]
    if src.trunk is not None:
        programs.append(("trunk", TrunkModel(src.trunk), src.activations))
    for kind, module, expected in programs:
        folded = None           # BatchNorm folded, once per program, for the fp32 lowerings
        for runtime in r.inference_runtimes:
            quantized = kind == "inference" and runtime == "executorch" and r.quantize is not None
            logger.info("exporting %s %s%s artifact for %s", runtime, kind,
                        f" ({r.quantize})" if quantized else "", r.backbone)
            program_module, quantization = module, None
            if not quantized and runtime in ("executorch", "onnxruntime"):
                if folded is None:      # the same program, in under half the export's CPU
                    folded = fold_batch_norms(module, src.input_tensor)
                program_module = folded     # (the eager artifact keeps the module's own state dict)
            if quantized:
                program_module, quantization = _quantized(module, src, r.batch_size)
                refused = _quantized_parity_failure(
                    r, f"{kind}_xnnpack_int8.pte (its quantize/dequantize graph, before lowering)",
                    quantized_parity(_run_eager(program_module, src.inputs, r.batch_size), expected))
                if refused:     # already beyond tolerance before lowering: the lowering is skipped
                    failures.append(refused)
                    continue
            artifact = _inference_artifact(runtime, kind, program_module, src.input_tensor, src.draft,
                                           r.batch_size, quantization)
            outputs_of = INFERENCE_BACKENDS[runtime](artifact.data, artifact.spec, src.draft)
            if quantized:
                outputs, rows = run_for_parity(outputs_of, src.inputs, artifact.spec.batch.max)
                measured = quantized_parity(outputs, expected[rows])
                artifact.spec = dataclasses.replace(artifact.spec, parity={
                    **measured.to_json(), "tolerance": r.quantized_tolerance,
                    "tolerance_metric": "relative_l2_error", "min_cosine_bound": r.quantized_min_cosine,
                    "reference": "eager torch (fp32)",
                    "inputs": src.parity_images.source})
                refused = _quantized_parity_failure(r, artifact.spec.file, measured)
                if refused:
                    failures.append(refused)
            else:
                error = inference_parity(outputs_of, src.inputs, expected, artifact.spec.batch.max)
                artifact.spec = dataclasses.replace(artifact.spec, parity={
                    "max_abs_error": error, "tolerance": r.tolerance, "reference": "eager torch",
                    "inputs": src.parity_images.source})
                if not error <= r.tolerance:
                    failures.append(f"{artifact.spec.file}: max abs error {error:.3g} vs eager "
                                    f"exceeds tolerance {r.tolerance:g}")
            artifacts.append(artifact)
    return artifacts


def _checked_tail_eval(r: ExportRequest, src: _Sources, failures: list[str]) -> _Artifact:
    """The server's tail evaluation program (tail + head on trunk activations), checked on the
    eager trunk's activations of the parity images."""
    logger.info("exporting the server's tail evaluation program")
    artifact, error = _tail_eval_artifact(src.tail, src.head, src.activations, src.draft)
    artifact.spec = dataclasses.replace(artifact.spec, parity={
        "max_abs_error": error, "tolerance": r.tolerance, "reference": "eager torch",
        "inputs": f"eager trunk activations of {src.parity_images.source}"})
    if not error <= r.tolerance:
        failures.append(f"{artifact.spec.file}: max abs error {error:.3g} vs eager exceeds tolerance {r.tolerance:g}")
    return artifact


def _training_artifacts(r: ExportRequest, src: _Sources, failures: list[str]) -> list[_Artifact]:
    """The head's (and, with a tail, the tail + head's) training program per training runtime,
    each stepped in its runtime against torch autograd and ``torch.optim.SGD``."""
    artifacts = []
    rows = min(len(src.features), r.batch_size + max(1, r.batch_size // 4))  # a full + a padded chunk
    labels = (src.parity_images.labels[:rows] if src.parity_images.labels is not None
              else np.arange(rows)) % r.num_classes
    trainables = [(None, src.features)]
    if src.tail is not None:
        trainables.append((src.tail, src.activations))
    for program_tail, program_inputs in trainables:
        for runtime in DEFAULT_TRAINING_RUNTIMES:
            logger.info("exporting %s %straining artifact", runtime, "" if program_tail is None else "tail ")
            artifact = _training_artifact(runtime, src.head, src.draft, r.batch_size, program_tail)
            trainer = TRAINING_BACKENDS[runtime](artifact.data, artifact.spec, src.draft)
            session = TrainingSession(trainer, artifact.spec, src.draft)
            measured = training_parity(session, program_inputs[:rows], labels.astype(np.int64), r.temperature,
                                       tail=copy.deepcopy(program_tail),
                                       lr=PARITY_LR if program_tail is None else TAIL_PARITY_LR)
            artifact.spec = dataclasses.replace(artifact.spec, parity={
                **measured.to_json(), "tolerance": r.gradient_tolerance,
                "reference": "torch autograd + torch.optim.SGD",
                "inputs": f"eager {'features' if program_tail is None else 'trunk activations'}"
                          f" of {src.parity_images.source}"})
            worst = worst_error([measured.loss_abs_error, measured.gradient_max_abs_error,
                                 measured.sgd_max_abs_error])
            if not worst <= r.gradient_tolerance:       # NaN fails too
                failures.append(
                    f"{artifact.spec.file}: loss error {measured.loss_abs_error:.3g} / gradient error "
                    f"{measured.gradient_max_abs_error:.3g} / SGD error {measured.sgd_max_abs_error:.3g}: "
                    f"over {r.gradient_tolerance:g}")
            artifacts.append(artifact)
    return artifacts


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


def _quantized(model: torch.nn.Module, src: _Sources, batch_size: int) -> tuple[torch.fx.GraphModule, dict]:
    """``model`` quantized to int8 on the calibration images, and the manifest's record of how."""
    draft, calibration = src.draft, src.calibration_images
    calibration_inputs = torch.from_numpy(to_model_input(
        calibration.images, draft.input.image_size, draft.input.mean, draft.input.std))
    return quantize_int8(model, src.input_tensor, calibration_inputs, batch_size), {
        "mode": "int8", "scheme": INT8_SCHEME, "calibration_images": len(calibration_inputs),
        "calibration_inputs": calibration.source}


def _run_eager(model: torch.nn.Module, inputs: np.ndarray, max_batch: int) -> np.ndarray:
    """``model`` on ``inputs`` in slices of at most ``max_batch`` rows (the bound it was traced with)."""
    with torch.no_grad():
        return np.concatenate([model(torch.from_numpy(inputs[start:start + max_batch])).numpy()
                               for start in range(0, len(inputs), max_batch)])


def _quantized_parity_failure(r: ExportRequest, file: str, measured: QuantizedParity) -> str | None:
    """Why an int8 program is refused, or None: its relative L2 error over all rows, or its worst row's
    cosine (an aggregate lets one broken row through). Checked twice: on the quantize/dequantize graph
    before lowering (a badly calibrated program is refused without paying for the lowering), then on
    the lowered program as the device runs it."""
    reasons = []
    if not measured.relative_l2_error <= r.quantized_tolerance:
        reasons.append(f"relative L2 error {measured.relative_l2_error:.3g} vs eager fp32 exceeds tolerance "
                       f"{r.quantized_tolerance:g}")
    if not measured.min_cosine_similarity >= r.quantized_min_cosine:
        reasons.append(f"worst row's cosine with eager fp32 {measured.min_cosine_similarity:.3g} is below "
                       f"{r.quantized_min_cosine:g}")
    return f"{file}: {'; '.join(reasons)}" if reasons else None


def _inference_artifact(runtime: str, kind: str, model: torch.nn.Module, example: torch.Tensor,
                        draft: Manifest, batch_size: int, quantization: dict | None = None) -> _Artifact:
    """``kind`` "inference" (``InferenceModel``) or "trunk" (``TrunkModel``); with
    ``quantization`` (ExecuTorch only) ``model`` is already the int8 graph it describes."""
    max_batch = None  # ONNX and eager take any batch
    output_spec = _output_spec(draft, kind)
    if runtime == "executorch":
        suffix = "" if quantization is None else "_int8"
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
