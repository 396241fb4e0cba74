"""int8 ExecuTorch programs (``fedfleet export --quantize int8``): what the manifest records,
closeness to eager fp32 on real images the export never saw, that the program really is
int8 (different outputs, int8-sized file), refusal beyond tolerance, bad requests.

Two int8 MobileNetV2 exports at 32 px (about 25 s each on one core, mostly ExecuTorch's
lowering), both through the command line: the module's bundle, and one refused.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics.pairwise import cosine_similarity

from edge_client.data.idx import load_fashion_mnist
from edge_client.models import build_backbone
from edge_client.models.preprocess import to_model_input
from edge_client.runtime import load_inference, read_manifest
from export import export_bundle
from export.cli import main
from export import pipeline
from export.parity import load_calibration_images
from export.pipeline import INT8_MIN_ROW_COSINE, INT8_RELATIVE_ERROR_TOLERANCE, ExportError, ExportRequest
from export.quantization import quantized_parity

pytestmark = pytest.mark.slow  # int8 exports and calibration: xdist starts this file first

IMAGE_SIZE = 32
CALIBRATION_COUNT = 32
FP32_TOLERANCE = 1e-4  # the fp32 artifacts' rule, unchanged by quantization


def export_int8(out, batch_size: int, parity_count: int, runtimes: str, *calibration: str) -> int:
    """``fedfleet export`` of a 3-class int8 MobileNetV2 at IMAGE_SIZE without training programs;
    ``calibration``: the calibration options (default: CALIBRATION_COUNT train images)."""
    return main(["--backbone", "mobilenet_v2", "--num-classes", "3", "--out", str(out),
                 "--image-size", str(IMAGE_SIZE), "--batch-size", str(batch_size), "--parity-count", str(parity_count),
                 "--runtimes", runtimes, "--no-training", "--quantize", "int8",
                 *(calibration or ("--calibration-count", str(CALIBRATION_COUNT)))])


@pytest.fixture(scope="module")
def int8_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("int8") / "bundle"
    code = export_int8(out, 8, 16, "executorch,eager")
    assert code == 0
    return out / "manifest.json"


@pytest.fixture(scope="module")
def unseen_images():
    """Test images past the parity images (test[0:16]); calibration used train images."""
    return load_fashion_mnist("test")[0][1000:1040]


def eager_fp32_features(images):
    backbone = build_backbone("mobilenet_v2")
    inputs = to_model_input(images, IMAGE_SIZE, backbone.mean, backbone.std)
    with torch.no_grad():
        return inputs, backbone(torch.from_numpy(inputs)).numpy()


def test_manifest_records_the_quantization(int8_bundle, capsys):
    manifest = read_manifest(int8_bundle)
    pte = manifest.find("inference", "executorch")
    assert pte.file == "inference_xnnpack_int8.pte"
    quantization = pte.details["quantization"]
    assert quantization["mode"] == "int8" and "per output channel" in quantization["scheme"]
    assert quantization["calibration_images"] == CALIBRATION_COUNT
    assert quantization["calibration_inputs"].startswith("fashion-mnist train")
    assert pte.details["delegate_calls"] == 1 and pte.details["portable_ops"] == {}
    parity = pte.parity
    assert parity["tolerance"] == INT8_RELATIVE_ERROR_TOLERANCE
    assert parity["tolerance_metric"] == "relative_l2_error"
    assert 0 < parity["relative_l2_error"] <= INT8_RELATIVE_ERROR_TOLERANCE
    assert -1 <= parity["min_cosine_similarity"] <= parity["mean_cosine_similarity"] <= 1
    assert parity["min_cosine_bound"] == INT8_MIN_ROW_COSINE <= parity["min_cosine_similarity"]
    # The fp32 artifact of the same bundle keeps the fp32 rule and has no quantization.
    eager = manifest.find("inference", "eager")
    assert "quantization" not in eager.details
    assert eager.parity["tolerance"] == FP32_TOLERANCE
    assert eager.parity["max_abs_error"] <= FP32_TOLERANCE


def test_int8_features_stay_close_to_fp32_on_unseen_images(int8_bundle, unseen_images):
    inputs, expected = eager_fp32_features(unseen_images)
    runtime = load_inference(int8_bundle)          # the device default picks the .pte
    assert runtime.runtime == "executorch"
    outputs = runtime.run(inputs)                  # 40 rows: 5 calls of the 8-row program
    assert outputs.shape == expected.shape and outputs.dtype == np.float32
    relative = np.linalg.norm(outputs - expected) / np.linalg.norm(expected)
    assert relative <= INT8_RELATIVE_ERROR_TOLERANCE
    cosines = np.diag(cosine_similarity(outputs.astype(np.float64), expected.astype(np.float64)))
    assert cosines.mean() >= 0.9, cosines
    # Really quantized: far beyond what fp32 programs are allowed to differ by.
    assert np.max(np.abs(outputs - expected)) > 100 * FP32_TOLERANCE
    # Rows do not depend on the batch they run in (calls of 1 row and of 8 rows).
    np.testing.assert_allclose(runtime.run(inputs[:1]), outputs[:1], atol=1e-5)


def test_int8_program_stores_int8_weights(int8_bundle):
    manifest = read_manifest(int8_bundle)
    pte = manifest.find("inference", "executorch")
    # The program's weights: the convolutions (BatchNorm is folded into them; the ImageNet
    # classifier is not part of a feature extractor).
    weights = sum(module.weight.numel() for module in build_backbone("mobilenet_v2").modules()
                  if isinstance(module, torch.nn.Conv2d))
    # fp32 would take 4 bytes per weight; int8 takes 1 (+ per-channel scales, biases, graph).
    assert weights < pte.size_bytes < 0.35 * 4 * weights
    assert (int8_bundle.parent / pte.file).stat().st_size == pte.size_bytes


def test_badly_calibrated_program_is_refused_and_nothing_written(tmp_path, capsys):
    """Calibrated on black images, the activation ranges miss what real images produce: the
    default tolerance must catch it (0.70 relative L2 error when this test was written)."""
    black = tmp_path / "black.npy"
    np.save(black, np.zeros((8, 28, 28), np.uint8))
    out = tmp_path / "bundle"
    code = export_int8(out, 1, 8, "executorch", "--calibration-images", str(black))
    assert code == 1
    err = capsys.readouterr().err
    assert "no artifact written" in err and "relative L2 error" in err
    assert "inference_xnnpack_int8.pte" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["black.npy"]


def one_row_broken(outputs: np.ndarray) -> np.ndarray:
    """``outputs`` with its smallest row sign-flipped: a row pointing away from fp32's (cosine -1) that
    moves the relative L2 error over all rows by little."""
    broken = outputs.copy()
    row = np.argmin(np.linalg.norm(outputs, axis=1))
    broken[row] = -broken[row]
    return broken


def test_one_broken_row_fails_the_int8_check_that_the_relative_error_passes():
    rng = np.random.default_rng(0)
    reference = rng.random((64, 40))                   # non-negative, as pooled ReLU6 features are
    reference[7] *= 0.05                               # a near-black image's small features
    quantized = one_row_broken(reference * rng.normal(1.0, 0.15, reference.shape))
    cosines = np.diag(cosine_similarity(quantized, reference))
    assert cosines[7] == pytest.approx(-1, abs=0.05) and np.delete(cosines, 7).min() > 0.9
    request = ExportRequest("mobilenet_v2", "unused", num_classes=3, quantize="int8")
    measured = quantized_parity(quantized, reference)
    assert measured.relative_l2_error <= request.quantized_tolerance
    refused = pipeline._quantized_parity_failure(request, "inference_xnnpack_int8.pte", measured)
    assert refused is not None and "worst row's cosine" in refused and "relative L2" not in refused
    # the same outputs without the broken row pass
    intact = quantized.copy()
    intact[7] = -intact[7]
    assert pipeline._quantized_parity_failure(request, "x", quantized_parity(intact, reference)) is None


def test_an_int8_program_with_one_broken_row_is_refused_and_nothing_written(tmp_path, capsys, monkeypatch):
    """Through the export: the quantize/dequantize graph's outputs get one broken row (the check before
    lowering, so no lowering is paid for). The graph is the fp32 module itself (quantize_int8 stubbed
    out: the int8 bundle above pays for a real quantization once; what is tested here is the pipeline's
    refusal, whatever graph's outputs it judges)."""
    run_eager = pipeline._run_eager
    monkeypatch.setattr(pipeline, "quantize_int8", lambda model, example, calibration, batch_size: model)
    monkeypatch.setattr(pipeline, "_run_eager", lambda *args: one_row_broken(run_eager(*args)))
    out = tmp_path / "bundle"
    code = export_int8(out, 8, 16, "executorch")
    assert code == 1
    err = capsys.readouterr().err
    assert "no artifact written" in err and "worst row's cosine with eager fp32 -1" in err
    assert "relative L2" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("arguments,message", [
    (dict(quantize="int4"), "quantize must be"),
    (dict(quantize="int8", inference_runtimes=("onnxruntime",)), "add executorch"),
    (dict(quantize="int8", quantized_tolerance=math.nan), "quantized_tolerance"),
    (dict(quantize="int8", quantized_tolerance=-0.1), "quantized_tolerance"),
    (dict(quantize="int8", quantized_min_cosine=1.5), "quantized_min_cosine"),
    (dict(quantize="int8", quantized_min_cosine=math.nan), "quantized_min_cosine"),
])
def test_bad_quantization_requests_are_refused(tmp_path, arguments, message):
    with pytest.raises(ExportError, match=message):
        export_bundle("mobilenet_v2", tmp_path / "bundle", num_classes=3, image_size=IMAGE_SIZE,
                      training=False, **arguments)
    assert list(tmp_path.iterdir()) == []


def test_cli_calibration_options_need_quantize(tmp_path, capsys):
    assert main(["--backbone", "mobilenet_v2", "--num-classes", "3", "--out", str(tmp_path / "b"),
                 "--quantized-tolerance", "0.2"]) == 2
    assert "need --quantize" in capsys.readouterr().err
    assert main(["--backbone", "mobilenet_v2", "--num-classes", "3", "--out", str(tmp_path / "b"),
                 "--quantize", "int4"]) == 2
    assert list(tmp_path.iterdir()) == []


def test_calibration_images_are_real_and_checked(tmp_path):
    default = load_calibration_images(count=5)
    train = load_fashion_mnist("train")[0][:5]
    np.testing.assert_array_equal(default.images, train)
    bad = tmp_path / "floats.npy"
    np.save(bad, np.zeros((3, 8, 8), np.float32))
    with pytest.raises(ValueError, match="uint8"):
        load_calibration_images(bad)
    with pytest.raises(ValueError, match="count"):
        load_calibration_images(count=0)


def test_quantized_parity_metrics_match_an_independent_computation():
    rng = np.random.default_rng(0)
    reference = rng.random((6, 20)).astype(np.float32)
    outputs = (reference + rng.normal(0, 0.05, reference.shape)).astype(np.float32)
    measured = quantized_parity(outputs, reference)
    cosines = np.diag(cosine_similarity(outputs, reference))
    assert measured.relative_l2_error == pytest.approx(
        math.sqrt(((outputs.astype(float) - reference) ** 2).sum() / (reference.astype(float) ** 2).sum()))
    assert measured.min_cosine_similarity == pytest.approx(cosines.min(), rel=1e-6)
    assert measured.mean_cosine_similarity == pytest.approx(cosines.mean(), rel=1e-6)
    assert measured.max_abs_error == pytest.approx(np.abs(outputs - reference).max())
    # Non-finite outputs fail any tolerance; mismatched shapes and all-zero references are errors.
    broken = outputs.copy()
    broken[2, 3] = np.nan
    assert quantized_parity(broken, reference).relative_l2_error == math.inf
    with pytest.raises(ValueError, match="shape"):
        quantized_parity(outputs[:, :5], reference)
    with pytest.raises(ValueError, match="all zero"):
        quantized_parity(outputs, np.zeros_like(reference))


def test_the_emulated_fleet_extracts_through_the_int8_program(int8_bundle, unseen_images, tmp_path):
    """`simulate --runtime executorch-int8`: fedfleet.bundles finds the int8 bundle beside (not in
    place of) the fp32 one, and its feature cache is keyed by the int8 program itself."""
    import shutil

    from fedfleet.bundles import bundle_dir, make_extractor

    root = tmp_path / "bundles"
    fp32_dir = bundle_dir("mobilenet_v2", IMAGE_SIZE, root)
    shutil.copytree(int8_bundle.parent, root / f"{fp32_dir.name}-int8")    # as ensure_bundle would export it
    extractor = make_extractor("mobilenet_v2", IMAGE_SIZE, str(tmp_path / "features"), "executorch-int8",
                               bundle_root=root)
    assert not fp32_dir.exists()                                           # the fp32 bundle was not touched
    program = load_inference(int8_bundle, prefer=("executorch",))
    inputs, _ = eager_fp32_features(unseen_images)
    features = extractor.extract(unseen_images)
    np.testing.assert_allclose(features, program.run(inputs), atol=1e-5)
    artifact = read_manifest(int8_bundle).find("inference", "executorch")
    assert artifact.file.endswith("_int8.pte") and artifact.sha256[:16] in extractor.cache_key
    np.testing.assert_array_equal(extractor.extract(unseen_images), features)   # served from the cache
    assert list((tmp_path / "features").iterdir())
