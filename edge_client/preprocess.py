"""Turn raw device images into the normalised NCHW float32 batch a backbone expects.

Steps: validate -> scale to 0..1 -> bilinear resize to ``size`` x ``size`` -> per-channel
``(x - mean) / std``. Grayscale images are resized once and then copied into the three
channels (ImageNet backbones expect RGB).

Resizing is plain numpy (a torch-free device, ``fedfleet[device]``, preprocesses too) and computes
what ``torch.nn.functional.interpolate(mode="bilinear", align_corners=False, antialias=False)``
does: half-pixel centres, like OpenCV's INTER_LINEAR. Without antialiasing,
strong downscaling (more than 2x) aliases; the devices in fedfleet upscale small images
(e.g. 28 px Fashion-MNIST to 32..128 px), where antialiasing makes no difference, and the
exported runtimes implement the same plain bilinear kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["to_model_input", "validate_images"]

_FLOAT_DTYPES = (np.float32, np.float64)


def validate_images(images: object) -> np.ndarray:
    """Check an image batch; returns it unchanged, or raises ValueError saying what is wrong.

    Accepted: uint8 pixels 0..255, or float32/float64 pixels in [0, 1] (all finite), shaped
    (N, H, W) grayscale, (N, H, W, 1) grayscale or (N, H, W, 3) RGB.
    """
    if not isinstance(images, np.ndarray):
        raise ValueError(f"images must be a numpy array, got {type(images).__name__}")
    if images.ndim not in (3, 4):
        raise ValueError(
            f"images must be (N, H, W) grayscale or (N, H, W, 3) RGB, got shape {images.shape}")
    if images.ndim == 4 and images.shape[-1] not in (1, 3):
        raise ValueError(
            f"images must have 1 or 3 channels in the last axis, got shape {images.shape}")
    if images.shape[1] == 0 or images.shape[2] == 0:
        raise ValueError(f"images must have non-zero height and width, got shape {images.shape}")
    if images.dtype == np.uint8:
        return images
    if images.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"images must be uint8 (0..255) or float32/float64 (0..1), got dtype {images.dtype}")
    if images.size:
        if not np.isfinite(images).all():
            raise ValueError("images contain NaN or infinite values")
        low, high = float(images.min()), float(images.max())
        if low < 0.0 or high > 1.0:
            raise ValueError(
                f"float images must lie in [0, 1], got values in [{low:.4g}, {high:.4g}]")
    return images


def _check_channel_stats(values: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float32)
    if array.shape != (3,) or not np.isfinite(array).all():
        raise ValueError(f"{what} must be three finite numbers, got {values!r}")
    return array


def to_model_input(images: np.ndarray, size: int, mean: Sequence[float],
                   std: Sequence[float]) -> np.ndarray:
    """uint8/float images (N,H,W) or (N,H,W,3) -> float32 (N, 3, size, size), C-contiguous."""
    images = validate_images(images)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    mean_array = _check_channel_stats(mean, "mean")
    std_array = _check_channel_stats(std, "std")
    if (std_array <= 0).any():
        raise ValueError(f"std must be positive, got {std!r}")

    if images.ndim == 3:
        images = images[..., None]
    # np.array copies: the caller's array may be read-only (np.frombuffer, memory maps).
    pixels = np.array(images, dtype=np.float32)
    if images.dtype == np.uint8:
        pixels /= np.float32(255.0)
    if pixels.shape[1:3] != (size, size):
        pixels = _resize_bilinear(pixels, int(size))
    if pixels.shape[-1] == 1:
        pixels = np.repeat(pixels, 3, axis=-1)  # grayscale -> RGB
    normalised = (pixels - mean_array) / std_array
    return np.ascontiguousarray(normalised.transpose(0, 3, 1, 2), dtype=np.float32)


def _linear_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Source rows i0, i1 and the weight of i1 for each output row, as torch computes them in
    float32: source = max((dst + 0.5) * in / out - 0.5, 0), i1 = min(i0 + 1, in - 1)."""
    scale = np.float32(in_size) / np.float32(out_size)
    source = np.maximum((np.arange(out_size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5),
                        np.float32(0))
    i0 = source.astype(np.int64)
    i1 = np.minimum(i0 + 1, in_size - 1)
    return i0, i1, np.clip(source - i0.astype(np.float32), 0, 1).astype(np.float32)


def _resize_bilinear(pixels: np.ndarray, size: int) -> np.ndarray:
    """(N, H, W, C) float32 -> (N, size, size, C): separable linear interpolation, height then width."""
    i0, i1, w1 = _linear_taps(pixels.shape[1], size)
    w1 = w1[None, :, None, None]
    pixels = pixels[:, i0] * (np.float32(1) - w1) + pixels[:, i1] * w1
    i0, i1, w1 = _linear_taps(pixels.shape[2], size)
    w1 = w1[None, None, :, None]
    return pixels[:, :, i0] * (np.float32(1) - w1) + pixels[:, :, i1] * w1
