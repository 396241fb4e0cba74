"""The export manifest: what a bundle holds and how to feed it, as typed objects and JSON.

One bundle directory = ``manifest.json`` + the files it lists. ``export`` writes manifests
with :meth:`Manifest.to_json`; devices read them with :func:`read_manifest`, so the format
is defined once, here, in ``protocols`` (export, devices and the aggregator all read it). Reading validates the JSON against :data:`MANIFEST_SCHEMA` and
checks the cross-field rules the schema cannot express (unique files, shapes agreeing with
the model), so later code can trust every field. Reading does *not* hash the files:
:mod:`edge_client.runtime.verification` does that, on the bytes it hands to a runtime.

Shapes use ``None`` (JSON ``null``) for the batch dimension. ``batch.max`` bounds it
(ExecuTorch programs are memory-planned for an upper bound; ``null`` = unbounded, as in
ONNX); ``batch.fixed`` means every call must use exactly ``batch.max`` rows (the training
program), so the runtime pads the last partial batch and gives padded rows weight 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema

from protocols.envelope import parse_strict_json
from protocols.regular_file import open_regular


class ArtifactError(RuntimeError):
    """Base class: an exported bundle cannot be used."""


class ManifestError(ArtifactError, ValueError):
    """The manifest is not valid JSON, or does not follow the manifest schema."""

__all__ = [
    "ARTIFACT_KINDS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_FILENAME",
    "MANIFEST_SCHEMA",
    "RUNTIME_NAMES",
    "ArtifactSpec",
    "BatchSpec",
    "InputNormalisation",
    "Manifest",
    "TailSpec",
    "TensorSpec",
    "read_manifest",
]

FORMAT_NAME = "fedfleet-export"
FORMAT_VERSION = 1
MANIFEST_FILENAME = "manifest.json"
# inference: images -> features/logits; training: the head's program (features in);
# trunk: images -> activations before the tail; tail_training: tail + head program (activations in);
# tail_eval: activations -> logits (torch.export), for the server's evaluation of FT(φ)/FT(M)
ARTIFACT_KINDS = ("inference", "training", "trunk", "tail_training", "tail_eval")
RUNTIME_NAMES = ("executorch", "onnxruntime", "eager")
# The largest manifest a device will parse; real ones are a few kB.
MAX_MANIFEST_BYTES = 1 << 20

# A plain file name inside the bundle directory: no separators, no "..", no hidden files.
_FILE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_SHA256_PATTERN = r"^[0-9a-f]{64}$"
_DTYPES = ("float32", "int64")

_TENSOR_SCHEMA = {
    "type": "object",
    "required": ["name", "dtype", "shape"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_.]*$"},
        "dtype": {"enum": list(_DTYPES)},
        "shape": {
            "type": "array",
            "maxItems": 8,
            "items": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
        },
    },
}

_ARTIFACT_SCHEMA = {
    "type": "object",
    "required": ["kind", "runtime", "runtime_version", "file", "sha256", "size_bytes",
                 "batch", "inputs", "outputs", "parity", "details"],
    "additionalProperties": False,
    "properties": {
        "kind": {"enum": list(ARTIFACT_KINDS)},
        "runtime": {"enum": list(RUNTIME_NAMES)},
        "runtime_version": {"type": "string", "minLength": 1},
        "file": {"type": "string", "pattern": _FILE_NAME_PATTERN},
        "sha256": {"type": "string", "pattern": _SHA256_PATTERN},
        "size_bytes": {"type": "integer", "minimum": 1},
        "batch": {
            "type": "object",
            "required": ["max", "fixed"],
            "additionalProperties": False,
            "properties": {
                "max": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
                "fixed": {"type": "boolean"},
            },
        },
        "inputs": {"type": "array", "minItems": 1, "items": _TENSOR_SCHEMA},
        "outputs": {"type": "array", "minItems": 1, "items": _TENSOR_SCHEMA},
        "parity": {"type": "object", "additionalProperties": {"type": ["number", "string", "integer"]}},
        "details": {"type": "object"},
    },
}

MANIFEST_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["format", "format_version", "backbone", "task", "input", "artifacts",
                 "created_with"],
    "additionalProperties": False,
    "properties": {
        "format": {"const": FORMAT_NAME},
        "format_version": {"const": FORMAT_VERSION},
        "backbone": {
            "type": "object",
            "required": ["name", "weights_sha256", "feature_dim"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "weights_sha256": {"type": "string", "pattern": _SHA256_PATTERN},
                "feature_dim": {"type": "integer", "minimum": 1},
                # [lo, hi] every feature lies in (optional: not every backbone bounds it)
                "feature_range": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
            },
        },
        "task": {
            "type": "object",
            "required": ["num_classes", "temperature", "output"],
            "additionalProperties": False,
            "properties": {
                "num_classes": {"type": "integer", "minimum": 1},
                "temperature": {"type": "number", "exclusiveMinimum": 0},
                "output": {"enum": ["features", "logits"]},
            },
        },
        "input": {
            "type": "object",
            "required": ["name", "dtype", "layout", "image_size", "mean", "std", "pixel_scale",
                         "resize", "grayscale"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string"},
                "dtype": {"const": "float32"},
                "layout": {"const": "NCHW"},
                "image_size": {"type": "integer", "minimum": 1},
                "mean": {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3},
                "std": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0},
                        "minItems": 3, "maxItems": 3},
                "pixel_scale": {"type": "number", "exclusiveMinimum": 0},
                "resize": {"type": "string"},
                "grayscale": {"type": "string"},
            },
        },
        "artifacts": {"type": "array", "minItems": 1, "maxItems": 32, "items": _ARTIFACT_SCHEMA},
        "tail": {
            "type": "object",
            "required": ["stages", "activation_shape", "parameters"],
            "additionalProperties": False,
            "properties": {
                "stages": {"type": "integer", "minimum": 1},
                "activation_shape": {"type": "array", "minItems": 3, "maxItems": 3,
                                     "items": {"type": "integer", "minimum": 1}},
                "parameters": {"type": "object", "minProperties": 1, "additionalProperties": {
                    "type": "array", "maxItems": 8, "items": {"type": "integer", "minimum": 1}}},
            },
        },
        "created_with": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One program input or output; ``None`` in ``shape`` marks the batch dimension."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TensorSpec":
        return cls(name=data["name"], dtype=data["dtype"], shape=tuple(data["shape"]))


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """``max`` rows per call (``None``: unbounded); ``fixed``: exactly ``max`` rows per call."""

    max: int | None
    fixed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"max": self.max, "fixed": self.fixed}


@dataclasses.dataclass(frozen=True)
class ArtifactSpec:
    """One file of the bundle and everything a runtime needs to run it.

    ``parity`` holds the errors measured against eager torch when the file was exported
    (``max_abs_error`` for inference; gradient / loss / SGD errors for training).
    ``details`` is runtime- and kind-specific (delegate, method name, loss, trainable
    parameters, ...).
    """

    kind: str
    runtime: str
    runtime_version: str
    file: str
    sha256: str
    size_bytes: int
    batch: BatchSpec
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parity: Mapping[str, Any]
    details: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "runtime": self.runtime,
            "runtime_version": self.runtime_version,
            "file": self.file,
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "batch": self.batch.to_json(),
            "inputs": [spec.to_json() for spec in self.inputs],
            "outputs": [spec.to_json() for spec in self.outputs],
            "parity": dict(self.parity),
            "details": dict(self.details),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ArtifactSpec":
        return cls(
            kind=data["kind"],
            runtime=data["runtime"],
            runtime_version=data["runtime_version"],
            file=data["file"],
            sha256=data["sha256"],
            size_bytes=data["size_bytes"],
            batch=BatchSpec(max=data["batch"]["max"], fixed=data["batch"]["fixed"]),
            inputs=tuple(TensorSpec.from_json(spec) for spec in data["inputs"]),
            outputs=tuple(TensorSpec.from_json(spec) for spec in data["outputs"]),
            parity=dict(data["parity"]),
            details=dict(data["details"]),
        )


@dataclasses.dataclass(frozen=True)
class InputNormalisation:
    """How raw pixels become the float32 NCHW input (see ``edge_client.preprocess``)."""

    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    name: str = "image"
    pixel_scale: float = 1.0 / 255.0
    resize: str = "bilinear, align_corners=False, antialias=False, to image_size x image_size"
    grayscale: str = "replicated into the 3 channels"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": "float32",
            "layout": "NCHW",
            "image_size": self.image_size,
            "mean": list(self.mean),
            "std": list(self.std),
            "pixel_scale": self.pixel_scale,
            "resize": self.resize,
            "grayscale": self.grayscale,
        }


@dataclasses.dataclass(frozen=True)
class TailSpec:
    """The backbone split for FT(φ)/FT(M) (``edge_client.models.tail``): the last ``stages``
    stages are trained on device from the trunk's activations of shape ``activation_shape``
    (c, h, w); ``parameters`` maps each trainable tail tensor (names as in the tail_training
    program, ``tail.`` prefix included) to its shape."""

    stages: int
    activation_shape: tuple[int, int, int]
    parameters: Mapping[str, tuple[int, ...]]

    def to_json(self) -> dict[str, Any]:
        return {"stages": self.stages, "activation_shape": list(self.activation_shape),
                "parameters": {name: list(shape) for name, shape in self.parameters.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TailSpec":
        return cls(stages=data["stages"], activation_shape=tuple(data["activation_shape"]),
                   parameters={name: tuple(shape) for name, shape in data["parameters"].items()})


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest; ``directory`` is where its files live."""

    backbone: str
    weights_sha256: str
    feature_dim: int
    num_classes: int
    temperature: float
    output: str  # what the inference artifacts return: "features" or "logits"
    input: InputNormalisation
    artifacts: tuple[ArtifactSpec, ...]
    created_with: Mapping[str, str]
    directory: Path = Path(".")
    tail: TailSpec | None = None  # present when the bundle can fine-tune the backbone's tail
    feature_range: tuple[float, float] | None = None  # what every feature lies in, if the backbone bounds it

    def find(self, kind: str, runtime: str) -> ArtifactSpec | None:
        for spec in self.artifacts:
            if spec.kind == kind and spec.runtime == runtime:
                return spec
        return None

    def runtimes_for(self, kind: str) -> list[str]:
        return [spec.runtime for spec in self.artifacts if spec.kind == kind]

    def head_parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.num_classes, self.feature_dim), "bias": (self.num_classes,)}

    def to_json(self) -> dict[str, Any]:
        extra = {} if self.tail is None else {"tail": self.tail.to_json()}
        bounded = {} if self.feature_range is None else {"feature_range": [float(v) for v in self.feature_range]}
        return {
            **extra,
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "backbone": {"name": self.backbone, "weights_sha256": self.weights_sha256,
                         "feature_dim": self.feature_dim, **bounded},
            "task": {"num_classes": self.num_classes, "temperature": self.temperature,
                     "output": self.output},
            "input": self.input.to_json(),
            "artifacts": [spec.to_json() for spec in self.artifacts],
            "created_with": dict(self.created_with),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, data: Mapping[str, Any], directory: Path = Path(".")) -> "Manifest":
        """Validate ``data`` (schema + cross-field rules) and build the typed manifest."""
        _validate(data)
        input_data = data["input"]
        manifest = cls(
            backbone=data["backbone"]["name"],
            weights_sha256=data["backbone"]["weights_sha256"],
            feature_dim=data["backbone"]["feature_dim"],
            num_classes=data["task"]["num_classes"],
            temperature=float(data["task"]["temperature"]),
            output=data["task"]["output"],
            input=InputNormalisation(
                image_size=input_data["image_size"],
                mean=tuple(float(v) for v in input_data["mean"]),
                std=tuple(float(v) for v in input_data["std"]),
                name=input_data["name"],
                pixel_scale=float(input_data["pixel_scale"]),
                resize=input_data["resize"],
                grayscale=input_data["grayscale"],
            ),
            artifacts=tuple(ArtifactSpec.from_json(item) for item in data["artifacts"]),
            created_with=dict(data["created_with"]),
            directory=Path(directory),
            tail=TailSpec.from_json(data["tail"]) if "tail" in data else None,
            feature_range=(tuple(float(v) for v in data["backbone"]["feature_range"])
                           if "feature_range" in data["backbone"] else None),
        )
        _check_consistency(manifest)
        return manifest


def _whole_string_pattern(validator, pattern: str, instance: Any, schema: Any):
    # A schema's patterns are ECMA-262's, whose "$" matches only at the end of the string; under
    # Python's re.search (jsonschema's) it also matches before a final newline, and a manifest
    # listing "inference_eager.pt\n" passed. Every pattern of MANIFEST_SCHEMA is anchored (^...$),
    # so a full match is the ECMA-262 one.
    if validator.is_type(instance, "string") and not re.fullmatch(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_MANIFEST_VALIDATOR = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                                   {"pattern": _whole_string_pattern})


def _validate(data: Any) -> None:
    validator = _MANIFEST_VALIDATOR(MANIFEST_SCHEMA)
    errors = sorted(validator.iter_errors(data), key=lambda error: list(error.absolute_path))
    if errors:
        first = errors[0]
        where = "/".join(str(part) for part in first.absolute_path) or "<root>"
        raise ManifestError(f"manifest does not follow the schema at {where}: {first.message}")


def _check_consistency(manifest: Manifest) -> None:
    if not math.isfinite(manifest.temperature):
        raise ManifestError("manifest task.temperature must be finite")
    if manifest.feature_range is not None:
        lo, hi = manifest.feature_range
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ManifestError(f"manifest backbone.feature_range {[lo, hi]} must be finite with lo <= hi")
    seen_files: set[str] = set()
    seen_pairs: set[tuple[str, str]] = set()
    for spec in manifest.artifacts:
        if spec.file in seen_files or spec.file == MANIFEST_FILENAME:
            raise ManifestError(f"manifest lists file {spec.file!r} twice (or as the manifest)")
        seen_files.add(spec.file)
        if (spec.kind, spec.runtime) in seen_pairs:
            raise ManifestError(f"manifest has two {spec.kind} artifacts for {spec.runtime}")
        seen_pairs.add((spec.kind, spec.runtime))
        if spec.batch.fixed and spec.batch.max is None:
            raise ManifestError(f"{spec.file}: a fixed batch needs batch.max")
        if spec.kind == "inference":
            expected = (None, 3, manifest.input.image_size, manifest.input.image_size)
            if len(spec.inputs) != 1 or spec.inputs[0].shape != expected:
                raise ManifestError(
                    f"{spec.file}: inference input must be one tensor of shape {expected}, "
                    f"got {[s.shape for s in spec.inputs]}")
            width = manifest.feature_dim if manifest.output == "features" else manifest.num_classes
            if len(spec.outputs) != 1 or spec.outputs[0].shape != (None, width):
                raise ManifestError(
                    f"{spec.file}: inference output must be one ({manifest.output}) tensor of "
                    f"shape (None, {width}), got {[s.shape for s in spec.outputs]}")
        elif spec.kind == "trunk":
            tail = _require_tail(manifest, spec)
            expected_in = (None, 3, manifest.input.image_size, manifest.input.image_size)
            expected_out = (None, *tail.activation_shape)
            if len(spec.inputs) != 1 or spec.inputs[0].shape != expected_in \
                    or len(spec.outputs) != 1 or spec.outputs[0].shape != expected_out:
                raise ManifestError(
                    f"{spec.file}: a trunk maps {expected_in} images to {expected_out} activations, "
                    f"got {[s.shape for s in spec.inputs]} -> {[s.shape for s in spec.outputs]}")
        elif spec.kind == "tail_eval":
            tail = _require_tail(manifest, spec)
            expected_in, expected_out = (None, *tail.activation_shape), (None, manifest.num_classes)
            parameters = spec.details.get("parameters")
            expected_json = {name: list(shape) for name, shape in
                             {**tail.parameters, **manifest.head_parameter_shapes()}.items()}
            if len(spec.inputs) != 1 or spec.inputs[0].shape != expected_in \
                    or len(spec.outputs) != 1 or spec.outputs[0].shape != expected_out \
                    or parameters != expected_json:
                raise ManifestError(f"{spec.file}: tail_eval maps {expected_in} activations to "
                                    f"{expected_out} logits with parameters {sorted(expected_json)}")
        else:
            expected_params = manifest.head_parameter_shapes()
            if spec.kind == "tail_training":
                tail = _require_tail(manifest, spec)
                expected_params = {**tail.parameters, **expected_params}
                if not spec.inputs or spec.inputs[0].shape[1:] != tail.activation_shape:
                    raise ManifestError(f"{spec.file}: the tail program takes activations of "
                                        f"shape (B, {', '.join(map(str, tail.activation_shape))})")
            params = spec.details.get("trainable_parameters")
            expected_json = {name: list(shape) for name, shape in expected_params.items()}
            if params != expected_json:
                raise ManifestError(
                    f"{spec.file}: trainable_parameters must be {expected_json}, got {params}")
            if not spec.batch.fixed:
                raise ManifestError(f"{spec.file}: training programs have a fixed batch")
            # the runtime pads every call to batch.max rows: a program planned for another batch fails
            # (or reads past its buffers) at its first step, long after the bundle was taken
            if any(t.shape and t.shape[0] != spec.batch.max for t in (*spec.inputs, *spec.outputs)):
                raise ManifestError(f"{spec.file}: every tensor of a training program leads with its fixed batch "
                                    f"{spec.batch.max}, got {[t.shape for t in (*spec.inputs, *spec.outputs)]}")


def _require_tail(manifest: Manifest, spec: ArtifactSpec) -> TailSpec:
    if manifest.tail is None:
        raise ManifestError(f"{spec.file}: a {spec.kind} artifact needs the manifest's tail section")
    if any(not name.startswith("tail.") for name in manifest.tail.parameters):
        raise ManifestError("tail parameters must be named tail.<...>")
    return manifest.tail


def read_manifest(path: str | Path) -> Manifest:
    """Parse and validate ``path`` (a manifest.json, or the bundle directory holding one)."""
    path, raw = read_manifest_bytes(path)
    return parse_manifest(raw, path)


def read_manifest_bytes(path: str | Path) -> tuple[Path, bytes]:
    """(the manifest's path, its bytes: at most MAX_MANIFEST_BYTES, read once) of ``path`` (a
    manifest.json, or the bundle directory holding one). Whoever checks the bytes' digest parses
    these same bytes (:func:`parse_manifest`): a file swapped after the check is never read."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_FILENAME
    try:
        with open_regular(path) as handle:
            raw = handle.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise ManifestError(f"no manifest at {path}") from None
    except OSError as error:
        raise ManifestError(f"cannot read {path}: {error}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes; not a manifest")
    return path, raw


def parse_manifest(raw: bytes, path: Path) -> Manifest:
    """The manifest ``raw`` holds, read from ``path`` (its artifacts lie beside it)."""
    try:        # as strict as the Java device's reader: no NaN, no key named twice (the last one won here)
        data = parse_strict_json(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as error:
        raise ManifestError(f"{path} is not valid JSON: {type(error).__name__}: {error}") from None
    return Manifest.from_json(data, directory=path.parent)
