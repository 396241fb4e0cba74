"""FDA style of a device's images: the mean low-frequency Fourier amplitude (LADD, spec §2.1).

For every image (RGB, float pixels 0..255, no normalisation; resized first to one fixed size
so that all devices and all test images are comparable, since the unnormalised FFT's DC term
grows with H·W):

    A_c = fftshift(|fft2(x_c)|)           per channel c, DC moved to (H//2, W//2)
    s_c = A_c[H//2-b : H//2+b+1, W//2-b : W//2+b+1]       the centred (2b+1)×(2b+1) window

The device's style is the mean of s over all its images: one float32 tensor (3, 2b+1, 2b+1)
(27 numbers for b = 1), sent once. Channel order is RGB (the LADD code uses BGR; only
consistency between devices and server matters). No log is taken, as in LADD, so k-means on
these vectors is dominated by the DC term (overall brightness per channel).

The same function gives the per-image styles used to route test images to a cluster.
"""

from __future__ import annotations

import numpy as np

__all__ = ["extract_style", "image_styles", "style_shape"]

# The most pixels (per channel) one FFT batch holds. Each costs about 170 bytes on the way (the
# float64 input, its complex spectrum, the amplitudes and their shifted copy, for 3 channels), and
# the size is the task's to choose (up to 1,024 px a side): 256 images at 1,024 px, the old fixed
# batch, were 43 GB. One image at the largest size fits; at 32 px a batch is still 1,024 images.
MAX_STYLE_BATCH_PIXELS = 1024 * 1024


def style_shape(b: int) -> tuple[int, int, int]:
    return (3, 2 * b + 1, 2 * b + 1)


def _check(images: object, b: object, size: tuple[int, int] | None) -> tuple[np.ndarray, int]:
    if not isinstance(images, np.ndarray) or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be a numpy array (N, H, W, 3), got "
                         f"{getattr(images, 'shape', type(images).__name__)}")
    if len(images) == 0:
        raise ValueError("need at least one image to compute a style")
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0:
        raise ValueError(f"window half-width b must be an integer >= 0, got {b!r}")
    if images.dtype != np.uint8:
        if images.dtype not in (np.float32, np.float64):
            raise ValueError(f"images must be uint8 (0..255) or float (0..255), got {images.dtype}")
        if not np.isfinite(images).all():
            raise ValueError("images contain NaN or Inf")
        if images.min() < 0 or images.max() > 255:
            raise ValueError("float images must lie in [0, 255]")
    H, W = size if size is not None else images.shape[1:3]
    if 2 * b + 1 > min(H, W):
        raise ValueError(f"a {2 * b + 1}x{2 * b + 1} window does not fit {H}x{W} images")
    return images, int(b)


def _resized(images: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
    """float64 (N, H, W, 3) pixels 0..255 at ``size`` (bicubic, antialiased, like PIL's BICUBIC)."""
    x = images.astype(np.float64)
    if size is None or tuple(images.shape[1:3]) == tuple(size):
        return x
    import torch
    from torch.nn import functional as F

    t = torch.from_numpy(x).permute(0, 3, 1, 2)
    t = F.interpolate(t, size=tuple(int(s) for s in size), mode="bicubic", align_corners=False, antialias=True)
    return t.clamp(0, 255).permute(0, 2, 3, 1).numpy()


def image_styles(images: np.ndarray, b: int = 1, size: tuple[int, int] | None = None,
                 batch: int = 256) -> np.ndarray:
    """Per-image styles, float64 (N, 3, 2b+1, 2b+1); at most ``batch`` images and
    ``MAX_STYLE_BATCH_PIXELS`` pixels (as given and as resized) are transformed at once."""
    images, b = _check(images, b, size)
    H, W = size if size is not None else images.shape[1:3]
    # the pixels before the resize count too: a batch is made float64 at the images' own size
    batch = max(1, min(batch, MAX_STYLE_BATCH_PIXELS // max(H * W, images.shape[1] * images.shape[2])))
    out = []
    for start in range(0, len(images), batch):
        x = _resized(images[start:start + batch], size)
        H, W = x.shape[1:3]
        amp = np.abs(np.fft.fft2(x, axes=(1, 2)))
        amp = np.fft.fftshift(amp, axes=(1, 2))
        ch, cw = H // 2, W // 2
        window = amp[:, ch - b:ch + b + 1, cw - b:cw + b + 1, :]
        out.append(np.transpose(window, (0, 3, 1, 2)))
    return np.concatenate(out)


def extract_style(images: np.ndarray, b: int = 1, size: tuple[int, int] | None = None) -> np.ndarray:
    """The device's style: float32 (3, 2b+1, 2b+1), mean of the per-image windows."""
    return image_styles(images, b, size).mean(axis=0).astype(np.float32)
