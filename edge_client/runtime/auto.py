"""``--runtime auto``: the fastest of a bundle's inference programs on this device, by measurement.

A short calibration loads each inference artifact of the bundle whose runtime is installed here
(eager torch only where torch is; the ``.pte``, fp32 or int8, where ExecuTorch is; the ``.onnx``
where ONNX Runtime is), checks its output against a reference, and times it. The fastest one whose
output keeps parity wins; one that breaks parity is never picked, however fast.

**Parity** is judged as the export judged that artifact (its manifest ``parity``: max abs error
against eager fp32 within ``tolerance``, or for an int8 program the relative L2 error within its
``tolerance`` when ``tolerance_metric`` says so). The reference is eager torch's output where the
bundle has the eager program and torch is installed, else the fp32 reference output the exporter
recorded in the manifest (``details["fp32_reference"]`` of an inference artifact: eager fp32 on
:func:`calibration_images`). A bundle with neither is refused: nothing to check parity against.

**Timing** is the median of ``repeats`` calls on a batch of ``batch`` rows after one warm-up call,
in ms per image, with whatever thread counts the process has set (``fedfleet device --threads``).
"""

from __future__ import annotations

import base64
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.preprocess import to_model_input
from edge_client.runtime.errors import RuntimeUnavailableError
from edge_client.runtime.inference import INFERENCE_BACKENDS, INFERENCE_RUNTIMES
from edge_client.runtime.selection import open_first_available
from edge_client.runtime.verification import load_manifest
from protocols.bundle_manifest import ArtifactSpec, Manifest

__all__ = ["RuntimeTrial", "RuntimeCalibration", "calibration_images", "encode_reference", "load_fastest"]

log = logging.getLogger(__name__)

REFERENCE_KEY = "fp32_reference"
REFERENCE_ROWS = 2


def calibration_images(image_size: int, rows: int = REFERENCE_ROWS) -> np.ndarray:
    """Deterministic uint8 RGB test images (arithmetic patterns, no RNG: identical under every numpy)."""
    n, i, j, c = np.meshgrid(np.arange(rows), np.arange(image_size), np.arange(image_size), np.arange(3),
                             indexing="ij")
    return ((n * 53 + i * 37 + j * 17 + c * 91 + (i * j) % 29) % 256).astype(np.uint8)


def calibration_input(manifest: Manifest, rows: int = REFERENCE_ROWS) -> np.ndarray:
    m = manifest.input
    return to_model_input(calibration_images(m.image_size, rows), m.image_size, m.mean, m.std)


def encode_reference(outputs: np.ndarray) -> dict:
    """What the exporter records: eager fp32 outputs on :func:`calibration_images`."""
    outputs = np.ascontiguousarray(outputs, dtype="<f4")
    return {"inputs": f"edge_client.runtime.auto.calibration_images(image_size, {len(outputs)})",
            "shape": list(outputs.shape), "dtype": "float32", "base64": base64.b64encode(outputs.tobytes()).decode()}


def recorded_reference(manifest: Manifest, kind: str) -> np.ndarray | None:
    for spec in manifest.artifacts:
        ref = spec.details.get(REFERENCE_KEY) if spec.kind == kind else None
        if isinstance(ref, dict):
            try:
                values = np.frombuffer(base64.b64decode(ref["base64"], validate=True), dtype="<f4")
                return values.reshape([int(v) for v in ref["shape"]]).astype(np.float32)
            except (KeyError, TypeError, ValueError) as exc:
                raise RuntimeUnavailableError(f"the manifest's {REFERENCE_KEY} is malformed: {exc}") from exc
    return None


def parity_error(output: np.ndarray, reference: np.ndarray, spec: ArtifactSpec) -> tuple[float, float, str]:
    """(error, tolerance, metric) of ``output`` against ``reference``, by the artifact's own parity rule;
    ValueError when their shapes differ (subtracted with broadcasting, one row for two inputs scored 0)."""
    if output.shape != reference.shape:
        raise ValueError(f"output of shape {tuple(output.shape)}, the reference's is {tuple(reference.shape)}")
    metric = str(spec.parity.get("tolerance_metric", "max_abs_error"))
    tolerance = float(spec.parity.get("tolerance", 1e-4))
    diff = output.astype(np.float64) - reference.astype(np.float64)
    if metric == "relative_l2_error":
        error = float(np.linalg.norm(diff) / max(np.linalg.norm(reference), 1e-30))
    else:
        metric, error = "max_abs_error", float(np.abs(diff).max())
    return error, tolerance, metric


@dataclass
class RuntimeTrial:
    """One candidate's calibration: its speed and parity, or why it could not run."""
    runtime: str
    file: str = ""
    ms_per_image: float | None = None
    error: float | None = None
    tolerance: float | None = None
    metric: str = ""
    problem: str = ""                 # "" when it ran and kept parity

    @property
    def eligible(self) -> bool:
        return not self.problem and self.ms_per_image is not None

    def line(self) -> str:
        what = f"{self.ms_per_image:.3f} ms/image" if self.ms_per_image is not None else "not timed"
        parity = f", {self.metric} {self.error:.2e} (tolerance {self.tolerance:g})" if self.error is not None else ""
        return f"{self.runtime} ({self.file or '-'}): {what}{parity}{'; ' + self.problem if self.problem else ''}"


class RuntimeCalibration:
    """Times each installed runtime of a bundle on ``batch`` rows and checks its parity."""

    def __init__(self, batch: int = 8, repeats: int = 3, candidates: Sequence[str] = INFERENCE_RUNTIMES,
                 backends: dict | None = None):
        if batch < 1 or repeats < 1:
            raise ValueError("batch and repeats must be >= 1")
        self.batch, self.repeats, self.candidates = batch, repeats, tuple(candidates)
        self.backends = INFERENCE_BACKENDS if backends is None else backends

    def run(self, manifest: Manifest, kind: str = "inference") -> tuple[list[RuntimeTrial], dict]:
        """Every candidate's trial, and the loaded programs of those that ran (runtime -> program)."""
        programs, trials = {}, []
        for runtime in self.candidates:
            spec = manifest.find(kind, runtime)
            if spec is None:
                continue
            try:
                programs[runtime] = open_first_available(manifest, kind, (runtime,), self.backends)
            except RuntimeUnavailableError as exc:
                trials.append(RuntimeTrial(runtime, spec.file, problem=f"not installed: {str(exc)[:120]}"))
        reference = self._reference(manifest, kind, programs)
        x = calibration_input(manifest, REFERENCE_ROWS)
        batch = np.ascontiguousarray(np.resize(x, (self.batch, *x.shape[1:])))
        for runtime, program in programs.items():
            spec = manifest.find(kind, runtime)
            trial = RuntimeTrial(runtime, spec.file)
            try:
                trial.error, trial.tolerance, trial.metric = parity_error(program.run(x), reference, spec)
                if not trial.error <= trial.tolerance:
                    trial.problem = "breaks parity"
                program.run(batch)                      # warm-up: first-call allocations, thread start
                times = []
                for _ in range(self.repeats):
                    start = time.perf_counter()
                    program.run(batch)
                    times.append(time.perf_counter() - start)
                trial.ms_per_image = 1e3 * statistics.median(times) / self.batch
            except Exception as exc:   # a runtime that fails here is not a candidate; the others still are
                trial.problem = f"failed: {type(exc).__name__}: {exc}"
            trials.append(trial)
        return trials, programs

    @staticmethod
    def _reference(manifest: Manifest, kind: str, programs: dict) -> np.ndarray:
        if "eager" in programs:
            reference = programs["eager"].run(calibration_input(manifest, REFERENCE_ROWS))
        else:
            reference = recorded_reference(manifest, kind)
        if reference is None:
            raise RuntimeUnavailableError(
                f"--runtime auto needs a parity reference: the bundle in {manifest.directory} has no eager program "
                f"usable here and no recorded {REFERENCE_KEY} (re-export it with this fedfleet)")
        # every program is held to the reference's shape: it must be the manifest's, one row an image
        expected = (REFERENCE_ROWS, *next(s for s in manifest.artifacts if s.kind == kind).outputs[0].shape[1:])
        if reference.shape != expected:
            raise RuntimeUnavailableError(f"--runtime auto: the parity reference has shape {tuple(reference.shape)}, "
                                          f"not the manifest's {expected} for {REFERENCE_ROWS} images")
        return reference

    def choose(self, manifest: Manifest, kind: str = "inference"):
        """The fastest program that keeps parity, with ``.calibration`` (every trial) attached."""
        trials, programs = self.run(manifest, kind)
        eligible = sorted((t for t in trials if t.eligible), key=lambda t: t.ms_per_image)
        if not eligible:
            raise RuntimeUnavailableError(f"--runtime auto: no runtime of the bundle in {manifest.directory} runs here "
                                          "with parity: " + "; ".join(t.line() for t in trials))
        program = programs[eligible[0].runtime]
        program.manifest, program.calibration = manifest, trials
        log.info("runtime auto chose %s: %s", eligible[0].runtime, "; ".join(t.line() for t in trials))
        return program


def load_fastest(manifest_path: str | Path, expected_manifest_sha256: str | None = None, kind: str = "inference",
                 calibration: RuntimeCalibration | None = None):
    """Like :func:`edge_client.runtime.load_inference`, with the runtime chosen by calibration."""
    manifest = load_manifest(manifest_path, expected_manifest_sha256)
    return (calibration or RuntimeCalibration()).choose(manifest, kind)
