"""Preprocessing against independent numpy references; FeatureExtractor batching and cache."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

import edge_client.models
from edge_client.features import FeatureExtractor
from edge_client.models import build_backbone, weights_path, weights_sha256
from edge_client.preprocess import to_model_input
from opened_files import opened_files

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def random_images(count: int, height: int = 28, width: int = 28, channels: int | None = None,
                  seed: int = 0) -> np.ndarray:
    shape = (count, height, width) + ((channels,) if channels else ())
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def bilinear_axis_weights(in_size: int, out_size: int):
    """Half-pixel-centre linear interpolation (align_corners=False), written from the formula."""
    source = (np.arange(out_size) + 0.5) * (in_size / out_size) - 0.5
    source = np.clip(source, 0.0, None)
    lower = np.minimum(np.floor(source).astype(int), in_size - 1)
    upper = np.minimum(lower + 1, in_size - 1)
    upper_weight = source - lower
    return lower, upper, upper_weight


def bilinear_resize_reference(image: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """(H, W) float64 -> (out_h, out_w), interpolating rows, then columns."""
    top, bottom, row_weight = bilinear_axis_weights(image.shape[0], out_h)
    rows = image[top] * (1 - row_weight)[:, None] + image[bottom] * row_weight[:, None]
    left, right, col_weight = bilinear_axis_weights(image.shape[1], out_w)
    return rows[:, left] * (1 - col_weight) + rows[:, right] * col_weight


# -- preprocessing ------------------------------------------------------------------------------

def test_normalisation_matches_numpy_when_no_resize_is_needed():
    images = random_images(3, 20, 20, channels=3)
    batch = to_model_input(images, 20, IMAGENET_MEAN, IMAGENET_STD)
    expected = (images.astype(np.float64) / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
    np.testing.assert_allclose(batch, expected.transpose(0, 3, 1, 2), rtol=1e-5, atol=1e-5)
    assert batch.dtype == np.float32 and batch.flags.c_contiguous


@pytest.mark.parametrize("in_shape, size", [((28, 28), 32), ((28, 28), 64), ((28, 28), 20),
                                            ((20, 30), 16), ((5, 9), 13)])
def test_resize_matches_numpy_bilinear_reference(in_shape, size):
    images = random_images(2, *in_shape, seed=4)
    batch = to_model_input(images, size, (0.5, 0.25, 0.0), (0.5, 2.0, 1.0))
    for index, image in enumerate(images):
        resized = bilinear_resize_reference(image / 255.0, size, size)
        for channel, (mean, std) in enumerate(zip((0.5, 0.25, 0.0), (0.5, 2.0, 1.0))):
            np.testing.assert_allclose(batch[index, channel], (resized - mean) / std,
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_shape, size", [((28, 28), 32), ((28, 28), 224), ((28, 28), 20), ((20, 30), 16)])
def test_numpy_resize_equals_torch_interpolate(in_shape, size):
    """The numpy path (what a torch-free device runs) computes torch's bilinear resize, which the
    exported programs were checked against, to float32 rounding."""
    from torch.nn import functional as F

    images = random_images(2, *in_shape, channels=3, seed=5)
    batch = to_model_input(images, size, (0.0,) * 3, (1.0,) * 3)
    pixels = torch.from_numpy(images.astype(np.float32) / 255.0).permute(0, 3, 1, 2)
    expected = F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False, antialias=False)
    np.testing.assert_allclose(batch, expected.numpy(), rtol=0, atol=1e-6)


def test_grayscale_is_copied_into_three_channels():
    gray = random_images(2, 28, 28, seed=5)
    from_gray = to_model_input(gray, 32, (0.5,) * 3, (0.5,) * 3)
    from_gray_channel = to_model_input(gray[..., None], 32, (0.5,) * 3, (0.5,) * 3)
    from_rgb = to_model_input(np.repeat(gray[..., None], 3, axis=-1), 32, (0.5,) * 3, (0.5,) * 3)
    assert from_gray.shape == (2, 3, 32, 32)
    np.testing.assert_array_equal(from_gray, from_gray_channel)
    np.testing.assert_allclose(from_gray, from_rgb, atol=1e-6)


def test_rgb_channel_order_is_kept():
    images = np.zeros((1, 4, 4, 3), np.uint8)
    images[..., 0] = 255  # pure red
    batch = to_model_input(images, 4, (0.0,) * 3, (1.0,) * 3)
    np.testing.assert_array_equal(batch[0, :, 0, 0], [1.0, 0.0, 0.0])


def test_float_images_in_unit_range_equal_uint8_path():
    images = random_images(2, 28, 28, seed=6)
    from_uint8 = to_model_input(images, 32, IMAGENET_MEAN, IMAGENET_STD)
    from_float = to_model_input(images.astype(np.float64) / 255.0, 32, IMAGENET_MEAN, IMAGENET_STD)
    np.testing.assert_allclose(from_uint8, from_float, atol=1e-6)


def test_read_only_input_is_accepted_and_untouched():
    images = random_images(2, 28, 28, seed=7)
    read_only = np.frombuffer(images.tobytes(), np.uint8).reshape(images.shape)
    assert not read_only.flags.writeable
    with np.testing.suppress_warnings() as warnings:
        warnings.record(UserWarning)
        batch = to_model_input(read_only, 32, IMAGENET_MEAN, IMAGENET_STD)
        assert not warnings.log
    np.testing.assert_array_equal(read_only, images)
    assert batch.shape == (2, 3, 32, 32)


@pytest.mark.parametrize("images, message", [
    ([[1, 2], [3, 4]], "numpy array"),
    (np.zeros((28, 28), np.uint8), "shape"),
    (np.zeros((1, 2, 28, 28, 3), np.uint8), "shape"),
    (np.zeros((2, 28, 28, 4), np.uint8), "channels"),
    (np.zeros((2, 0, 28), np.uint8), "height and width"),
    (np.zeros((2, 28, 28), np.int32), "dtype"),
    (np.zeros((2, 28, 28), bool), "dtype"),
    (np.full((2, 28, 28), np.nan, np.float32), "NaN"),
    (np.full((2, 28, 28), np.inf, np.float64), "NaN or infinite"),
    (np.full((2, 28, 28), 255.0, np.float32), r"\[0, 1\]"),
    (np.full((2, 28, 28), -0.1, np.float32), r"\[0, 1\]"),
])
def test_bad_images_are_rejected(images, message):
    with pytest.raises(ValueError, match=message):
        to_model_input(images, 32, IMAGENET_MEAN, IMAGENET_STD)


@pytest.mark.parametrize("size, mean, std, message", [
    (0, IMAGENET_MEAN, IMAGENET_STD, "size"),
    (-3, IMAGENET_MEAN, IMAGENET_STD, "size"),
    (2.5, IMAGENET_MEAN, IMAGENET_STD, "size"),
    (32, (0.5, 0.5), IMAGENET_STD, "mean"),
    (32, IMAGENET_MEAN, (0.2, 0.0, 0.2), "std must be positive"),
    (32, IMAGENET_MEAN, (0.2, float("nan"), 0.2), "std"),
])
def test_bad_preprocessing_parameters_are_rejected(size, mean, std, message):
    with pytest.raises(ValueError, match=message):
        to_model_input(random_images(1), size, mean, std)


# -- FeatureExtractor ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mobilenet():
    return build_backbone("mobilenet_v2")


class CountingForward:
    """The real backbone forward, counting the images it is asked to process."""

    def __init__(self, backbone):
        self.backbone = backbone
        self.images_seen = 0

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        self.images_seen += len(batch)
        with torch.inference_mode():
            return self.backbone(torch.from_numpy(batch)).numpy()


def counting_extractor(backbone, size: int = 32, **kw) -> tuple[CountingForward, FeatureExtractor]:
    """An extractor on the real backbone's forward (which counts its images), normalising as the backbone does."""
    forward = CountingForward(backbone)
    return forward, FeatureExtractor(forward, image_size=size, mean=backbone.mean, std=backbone.std, **kw)


def direct_features(backbone, images: np.ndarray, size: int) -> np.ndarray:
    batch = to_model_input(images, size, backbone.mean, backbone.std)
    with torch.inference_mode():
        return backbone(torch.from_numpy(batch)).numpy()


def test_batched_extraction_equals_one_forward_pass(mobilenet):
    images = random_images(20, seed=8)
    forward, extractor = counting_extractor(mobilenet, batch_size=7)
    features = extractor.extract(images)
    assert features.shape == (20, 1280) and features.dtype == np.float32
    assert forward.images_seen == 20
    np.testing.assert_allclose(features, direct_features(mobilenet, images, 32),
                               rtol=1e-4, atol=1e-5)


def test_feature_dim_is_probed_when_not_given(mobilenet):
    _, extractor = counting_extractor(mobilenet)
    assert extractor.feature_dim == 1280


def test_empty_batch_gives_empty_features(mobilenet):
    _, extractor = counting_extractor(mobilenet, feature_dim=1280)
    assert extractor.extract(np.zeros((0, 28, 28), np.uint8)).shape == (0, 1280)


def test_eager_extractor_uses_the_pretrained_backbone(mobilenet, tmp_path):
    images = random_images(5, seed=9)
    extractor = FeatureExtractor.eager("mobilenet_v2", image_size=32, cache_dir=tmp_path)
    assert extractor.feature_dim == 1280
    assert weights_sha256("mobilenet_v2") in extractor.cache_key
    assert "32" in extractor.cache_key and "eager" in extractor.cache_key
    np.testing.assert_allclose(extractor.extract(images), direct_features(mobilenet, images, 32),
                               rtol=1e-4, atol=1e-5)


def test_the_eager_extractor_reads_the_weights_once_and_keys_its_cache_on_their_digest(tmp_path):
    """It loaded the weights file (build_backbone), then read it again to hash it for the cache key
    (weights_sha256): two reads, and a key that need not name the weights loaded."""
    weights = os.path.realpath(weights_path("mobilenet_v2"))
    edge_client.models._file_sha256.cache_clear()   # as in a new process: no digest cached by another test
    with opened_files() as opened:
        extractor = FeatureExtractor.eager("mobilenet_v2", image_size=32, cache_dir=tmp_path)
    assert opened.count(weights) == 1
    with open(weights, "rb") as file:
        assert extractor.cache_key == f"mobilenet_v2:{hashlib.sha256(file.read()).hexdigest()}:32:eager"


def cache_files(directory):
    return sorted(path.name for path in directory.iterdir())


def test_cache_hit_returns_identical_features_without_running_the_model(mobilenet, tmp_path):
    images = random_images(10, seed=10)
    forward, extractor = counting_extractor(mobilenet, cache_dir=tmp_path, cache_key="mobilenet_v2-test")
    first = extractor.extract(images)
    assert forward.images_seen == 10
    files = cache_files(tmp_path)
    assert len(files) == 1 and files[0].endswith(".npy")  # no temporary file left behind

    again = extractor.extract(images.copy())  # same bytes, different array object
    assert forward.images_seen == 10
    np.testing.assert_array_equal(again, first)

    _, fresh = counting_extractor(mobilenet, cache_dir=tmp_path, cache_key="mobilenet_v2-test")
    np.testing.assert_array_equal(fresh.extract(images), first)


def test_cache_misses_on_other_images_size_key_or_shape(mobilenet, tmp_path):
    images = random_images(8, seed=11)

    def extractor(size=32, key="k"):
        return counting_extractor(mobilenet, size, cache_dir=tmp_path, cache_key=key)

    forward, base = extractor()
    base_features = base.extract(images)
    one_pixel_changed = images.copy()
    one_pixel_changed[3, 10, 10] ^= 1
    variants = [
        (extractor(), one_pixel_changed),
        (extractor(size=40), images),
        (extractor(key="other-model"), images),
        (extractor(), images.reshape(4, 56, 28)),  # same bytes, other shape
    ]
    for (forward, variant_extractor), variant_images in variants:
        features = variant_extractor.extract(variant_images)
        assert forward.images_seen == len(variant_images)
        assert features.shape == (len(variant_images), 1280)
    assert len(cache_files(tmp_path)) == 1 + len(variants)
    # The miss on one changed pixel recomputed that image's features: only row 3 moves.
    changed = extractor()[1].extract(one_pixel_changed)
    unchanged_rows = [row for row in range(8) if row != 3]
    np.testing.assert_allclose(changed[unchanged_rows], base_features[unchanged_rows], atol=1e-5)


def test_corrupt_cache_file_is_recomputed(mobilenet, tmp_path):
    images = random_images(4, seed=12)
    forward, extractor = counting_extractor(mobilenet, cache_dir=tmp_path, cache_key="k")
    first = extractor.extract(images)
    (cache_file,) = tmp_path.iterdir()
    cache_file.write_bytes(cache_file.read_bytes()[:100])  # truncated, as after a crash
    again = extractor.extract(images)
    assert forward.images_seen == 8
    np.testing.assert_array_equal(again, first)
    assert np.array_equal(np.load(cache_file), first)  # rewritten whole


def test_bad_images_fail_before_the_model_runs(mobilenet):
    forward, extractor = counting_extractor(mobilenet)
    with pytest.raises(ValueError, match="NaN"):
        extractor.extract(np.full((3, 28, 28), np.nan, np.float32))
    assert forward.images_seen == 0


@pytest.mark.parametrize("output, message", [
    (lambda batch: np.zeros((len(batch) + 1, 8), np.float32), "shape"),
    (lambda batch: np.zeros((len(batch),), np.float32), "shape"),
    (lambda batch: np.full((len(batch), 8), np.nan, np.float32), "NaN"),
])
def test_bad_forward_outputs_are_rejected(output, message):
    extractor = FeatureExtractor(output, image_size=8, mean=(0.5,) * 3, std=(0.5,) * 3)
    with pytest.raises(ValueError, match=message):
        extractor.extract(random_images(3))


def test_forward_changing_its_width_is_rejected():
    widths = iter([8, 9])
    extractor = FeatureExtractor(lambda batch: np.zeros((len(batch), next(widths)), np.float32),
                                 image_size=8, mean=(0.5,) * 3, std=(0.5,) * 3, batch_size=2)
    with pytest.raises(ValueError, match="expected 8"):
        extractor.extract(random_images(4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(cache_dir="somewhere", cache_key=""), "cache_key"),
    (dict(batch_size=0), "batch_size"),
    (dict(image_size=0), "size"),
    (dict(std=(1.0, 0.0, 1.0)), "std"),
])
def test_bad_extractor_settings_are_rejected(kwargs, message):
    settings = dict(image_size=32, mean=(0.5,) * 3, std=(0.5,) * 3) | kwargs
    with pytest.raises(ValueError, match=message):
        FeatureExtractor(lambda batch: batch.mean(axis=(2, 3)), **settings)
