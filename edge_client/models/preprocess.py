"""Turn raw device images into the normalised NCHW float32 batch a backbone expects.

Steps: validate -> scale to 0..1 -> bilinear resize to ``size`` x ``size`` -> per-channel
``(x - mean) / std``. Grayscale images are resized once and then copied into the three
channels (ImageNet backbones expect RGB).

Resizing uses ``torch.nn.functional.interpolate(mode="bilinear", align_corners=False,
antialias=False)``: half-pixel centres, like OpenCV's INTER_LINEAR. Without antialiasing,
strong downscaling (more than 2x) aliases; the devices in fedfleet upscale small images
(e.g. 28 px Fashion-MNIST to 32..128 px), where antialiasing makes no difference, and the
exported runtimes implement the same plain bilinear kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.nn import functional as F

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
    pixels = torch.from_numpy(np.array(images, dtype=np.float32)).permute(0, 3, 1, 2)
    if images.dtype == np.uint8:
        pixels = pixels / 255.0
    if pixels.shape[-2:] != (size, size):
        pixels = F.interpolate(pixels, size=(int(size), int(size)), mode="bilinear",
                               align_corners=False, antialias=False)
    pixels = pixels.expand(-1, 3, -1, -1)  # grayscale -> RGB; a no-op for RGB input
    mean_tensor = torch.from_numpy(mean_array).view(1, 3, 1, 1)
    std_tensor = torch.from_numpy(std_array).view(1, 3, 1, 1)
    normalised = (pixels - mean_tensor) / std_tensor
    return np.ascontiguousarray(normalised.numpy(), dtype=np.float32)
