"""``--runtime auto`` (edge_client.runtime.auto) on a tiny bundle with all three real runtimes: the
fastest runtime that keeps parity is chosen, one that breaks parity never is, and a device without
torch checks parity against the eager fp32 outputs the exporter recorded in the manifest."""

import json
import time

import numpy as np
import pytest

from edge_client.runtime import RuntimeUnavailableError, load_inference
from edge_client.runtime.auto import REFERENCE_KEY, RuntimeCalibration, calibration_images, load_fastest
from edge_client.runtime.inference import INFERENCE_BACKENDS
from edge_client.runtime.verification import load_manifest
from export.parity import load_parity_images

pytestmark = pytest.mark.slow  # exports (or waits for) the every-runtime bundle: xdist starts this file first

SIZE = 32


@pytest.fixture(scope="module")
def manifest_path(mobilenet_bundle_32px):
    return mobilenet_bundle_32px / "manifest.json"


def eager_outputs(manifest_path, images):
    from edge_client.preprocess import to_model_input

    program = load_inference(manifest_path, prefer=("eager",))
    m = program.manifest.input
    return program.run(to_model_input(images, m.image_size, m.mean, m.std))


class Slowed:
    """A real runtime with a fixed delay per call: makes the other candidate the faster one."""

    def __init__(self, program, delay_s):
        self.program, self.delay_s, self.runtime = program, delay_s, program.runtime

    def run(self, x):
        time.sleep(self.delay_s)
        return self.program.run(x)


class Skewed(Slowed):
    """A real runtime whose outputs are off by ``shift`` (a broken kernel, a wrong build)."""

    def __init__(self, program, shift):
        super().__init__(program, 0.0)
        self.shift = shift

    def run(self, x):
        return self.program.run(x) + np.float32(self.shift)


def backends(**wrappers):
    return {name: (lambda data, spec, manifest, make=make, wrap=wrappers.get(name):
                   wrap(make(data, spec, manifest)) if wrap else make(data, spec, manifest))
            for name, make in INFERENCE_BACKENDS.items()}


def test_the_fastest_runtime_that_keeps_parity_is_chosen(manifest_path):
    manifest = load_manifest(manifest_path)
    calibration = RuntimeCalibration(batch=4, repeats=3)
    program = calibration.choose(manifest)
    trials = {t.runtime: t for t in program.calibration}
    assert set(trials) == {"executorch", "onnxruntime", "eager"} and all(t.eligible for t in trials.values())
    assert program.runtime == min(trials.values(), key=lambda t: t.ms_per_image).runtime
    # each trial's parity error is that runtime's distance from eager on the calibration images
    reference = eager_outputs(manifest_path, calibration_images(SIZE))
    for name, trial in trials.items():
        from edge_client.preprocess import to_model_input

        m = manifest.input
        out = load_inference(manifest_path, prefer=(name,)).run(
            to_model_input(calibration_images(SIZE), SIZE, m.mean, m.std))
        assert trial.error == pytest.approx(float(np.abs(out - reference).max()), rel=1e-6, abs=1e-12)
        assert trial.metric == "max_abs_error" and trial.tolerance == 1e-4


def test_a_runtime_that_breaks_parity_is_never_chosen_however_fast(manifest_path):
    manifest = load_manifest(manifest_path)
    # ORT made the fastest by slowing the others; then its outputs shifted past the tolerance
    slow = dict(executorch=lambda p: Slowed(p, 0.05), eager=lambda p: Slowed(p, 0.05))
    fast_ort = RuntimeCalibration(batch=2, repeats=1, backends=backends(**slow)).choose(manifest)
    assert fast_ort.runtime == "onnxruntime"                        # the control: it wins while it is right
    broken = RuntimeCalibration(batch=2, repeats=1, backends=backends(**slow, onnxruntime=lambda p: Skewed(p, 1e-3)))
    program = broken.choose(manifest)
    trials = {t.runtime: t for t in program.calibration}
    assert program.runtime != "onnxruntime" and trials["onnxruntime"].problem == "breaks parity"
    assert trials["onnxruntime"].ms_per_image < trials[program.runtime].ms_per_image
    # with eager the reference, a skewed eager moves the reference; without it, nothing is left
    everything_broken = RuntimeCalibration(batch=2, repeats=1, candidates=("executorch", "onnxruntime"),
                                           backends=backends(**{name: (lambda p: Skewed(p, 1e-3))
                                                                for name in INFERENCE_BACKENDS}))
    with pytest.raises(RuntimeUnavailableError, match="no runtime .* with parity"):
        everything_broken.choose(manifest)


def test_without_torch_parity_is_checked_against_the_recorded_fp32_outputs(manifest_path, tmp_path):
    data = json.loads(manifest_path.read_text())
    (inference,) = [a for a in data["artifacts"] if a["kind"] == "inference" and REFERENCE_KEY in a["details"]]
    recorded = inference["details"][REFERENCE_KEY]
    values = np.frombuffer(__import__("base64").b64decode(recorded["base64"]), "<f4").reshape(recorded["shape"])
    # recomputed in this process: its convolutions may take another kernel than the exporting process's
    # (5.5e-6 apart in one CI run, where another test file had run first in the worker)
    np.testing.assert_allclose(values, eager_outputs(manifest_path, calibration_images(SIZE)), rtol=0, atol=1e-5)

    no_eager = RuntimeCalibration(batch=2, repeats=1, candidates=("executorch", "onnxruntime"))
    program = no_eager.choose(load_manifest(manifest_path))
    assert {t.runtime for t in program.calibration} == {"executorch", "onnxruntime"}
    assert all(t.eligible and t.error <= 1e-4 for t in program.calibration)

    def edited(change):
        copy = json.loads(manifest_path.read_text())
        change(next(a for a in copy["artifacts"] if a["file"] == inference["file"])["details"])
        path = manifest_path.parent / f"edited-{len(list(manifest_path.parent.glob('edited-*')))}.json"
        path.write_text(json.dumps(copy))
        return load_manifest(path)

    shifted = (values + np.float32(1e-3)).astype("<f4")
    wrong = edited(lambda d: d[REFERENCE_KEY].update(base64=__import__("base64").b64encode(shifted.tobytes()).decode()))
    with pytest.raises(RuntimeUnavailableError, match="breaks parity"):
        no_eager.choose(wrong)
    with pytest.raises(RuntimeUnavailableError, match="needs a parity reference"):
        no_eager.choose(edited(lambda d: d.pop(REFERENCE_KEY)))
    with pytest.raises(RuntimeUnavailableError, match="malformed"):
        no_eager.choose(edited(lambda d: d[REFERENCE_KEY].update(shape=[3, 7])))


def test_an_extractor_with_runtime_auto_says_what_it_chose(manifest_path):
    from edge_client.features import FeatureExtractor

    images = load_parity_images(count=6).images
    extractor = FeatureExtractor.from_bundle(manifest_path, "auto", None)
    assert extractor.runtime in {"executorch", "onnxruntime", "eager"} and len(extractor.calibration) == 3
    np.testing.assert_allclose(extractor.extract(images), eager_outputs(manifest_path, images), atol=1e-4)
    assert load_fastest(manifest_path).runtime in {"executorch", "onnxruntime", "eager"}
