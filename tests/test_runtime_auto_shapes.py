"""``--runtime auto`` holds every program to the shape of its outputs (a review's finding: output and
reference were subtracted with broadcasting, so a program answering one row for two images scored
no error, and was chosen when fastest). Small hand-written bundles and stand-in programs: no export."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge_client.runtime import RuntimeUnavailableError
from edge_client.runtime.auto import REFERENCE_KEY, REFERENCE_ROWS, RuntimeCalibration, encode_reference
from edge_client.runtime.verification import load_manifest
from export.manifest import describe_artifact, write_bundle
from protocols.bundle_manifest import BatchSpec, InputNormalisation, Manifest, TensorSpec

SIZE, FEATURES = 8, 4


class ConstantProgram:
    """Features of ones, ``rows(n)`` rows for n images, after ``delay_s``."""

    def __init__(self, rows, delay_s=0.0):
        self.rows, self.delay_s = rows, delay_s

    def run(self, x):
        time.sleep(self.delay_s)
        return np.ones((self.rows(len(x)), FEATURES), np.float32)


def _bundle(tmp_path, runtimes, details=None):
    artifacts = [describe_artifact("inference", runtime, "1", f"inference_{runtime}.bin", runtime.encode(),
                                   BatchSpec(None), (TensorSpec("image", "float32", (None, 3, SIZE, SIZE)),),
                                   (TensorSpec("features", "float32", (None, FEATURES)),), details or {},
                                   {"max_abs_error": 0.0, "tolerance": 1e-4})
                 for runtime in runtimes]
    manifest = Manifest(backbone="mobilenet_v2", weights_sha256="0" * 64, feature_dim=FEATURES, num_classes=2,
                        temperature=0.1, output="features", input=InputNormalisation(SIZE, (0.5,) * 3, (0.25,) * 3),
                        artifacts=tuple(artifacts), created_with={})
    return load_manifest(write_bundle(tmp_path / "bundle", manifest,
                                      {f"inference_{r}.bin": r.encode() for r in runtimes}))


def _backends(**programs):
    for runtime, program in programs.items():
        program.runtime = runtime
    return {runtime: (lambda data, spec, manifest, program=program: program) for runtime, program in programs.items()}


def test_a_program_answering_one_row_for_two_images_breaks_parity_however_fast(tmp_path):
    manifest = _bundle(tmp_path, ("eager", "onnxruntime"))
    one_row = ConstantProgram(lambda n: 1)
    calibration = RuntimeCalibration(batch=2, repeats=1, backends=_backends(
        eager=ConstantProgram(lambda n: n, delay_s=0.02), onnxruntime=one_row))
    program = calibration.choose(manifest)
    trials = {t.runtime: t for t in program.calibration}
    assert program.runtime == "eager" and trials["eager"].eligible and trials["eager"].error == 0.0
    assert not trials["onnxruntime"].eligible and "shape (1, 4)" in trials["onnxruntime"].problem


def test_a_recorded_reference_of_another_shape_than_the_manifests_is_refused(tmp_path):
    """Without eager, the reference is the one recorded: one row recorded, one row answered, and
    the shapes agreed; the reference is held to the manifest's (REFERENCE_ROWS, features)."""
    recorded = {REFERENCE_KEY: encode_reference(np.ones((1, FEATURES), np.float32))}
    manifest = _bundle(tmp_path, ("onnxruntime",), recorded)
    calibration = RuntimeCalibration(batch=2, repeats=1, candidates=("onnxruntime",),
                                     backends=_backends(onnxruntime=ConstantProgram(lambda n: 1)))
    with pytest.raises(RuntimeUnavailableError, match=rf"shape \(1, 4\), not the manifest's \({REFERENCE_ROWS}, 4\)"):
        calibration.choose(manifest)
