"""FDA styles (LADD): device extraction, server-side restyling, and the ``ladd.style`` payload."""

import numpy as np
import pytest

from fedfleet.ladd.pretrain import apply_style
from edge_client.style import extract_style, image_styles
from protocols import messages as M
from protocols.envelope import EnvelopeError, decode, encode
from protocols.payloads.ladd import encode_style, parse_style


def reference_style(images, b):
    """Independent numpy: per image and channel a 2-D FFT, a manual roll for the shift, then a crop."""
    out = []
    for img in images.astype(np.float64):
        per_channel = []
        for c in range(3):
            amp = np.abs(np.fft.fft2(img[:, :, c]))
            H, W = amp.shape
            amp = np.roll(np.roll(amp, H // 2, axis=0), W // 2, axis=1)   # DC -> (H//2, W//2)
            rows = [H // 2 + k for k in range(-b, b + 1)]
            cols = [W // 2 + k for k in range(-b, b + 1)]
            per_channel.append(amp[np.ix_(rows, cols)])
        out.append(per_channel)
    return np.mean(out, axis=0)


@pytest.mark.parametrize("shape,b,dtype", [((5, 32, 32), 1, np.uint8), ((3, 17, 24), 0, np.uint8),
                                           ((4, 20, 21), 2, np.float64), ((2, 64, 48), 1, np.float32)])
def test_style_matches_independent_numpy(shape, b, dtype):
    rng = np.random.default_rng(sum(shape) + b)
    images = rng.uniform(0, 255, shape + (3,))
    images = images.astype(dtype) if dtype != np.uint8 else np.round(images).astype(np.uint8)
    got = extract_style(images, b)
    assert got.shape == (3, 2 * b + 1, 2 * b + 1) and got.dtype == np.float32
    np.testing.assert_allclose(got, reference_style(images, b), rtol=1e-5)
    # the centre is the DC term: H·W times the channel mean
    np.testing.assert_allclose(got[:, b, b], images.reshape(len(images), -1, 3).astype(np.float64).sum(1).mean(0),
                               rtol=1e-5)


def test_per_image_styles_average_to_the_device_style():
    images = np.random.default_rng(0).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    per_image = image_styles(images, 1, batch=4)
    assert per_image.shape == (6, 3, 3, 3)
    np.testing.assert_allclose(per_image.mean(0), extract_style(images, 1), rtol=1e-6)


def test_resize_before_extraction_makes_sizes_comparable():
    img = np.full((2, 40, 40, 3), 100, np.uint8)
    small = extract_style(img, 1, size=(20, 20))
    np.testing.assert_allclose(small[:, 1, 1], 100 * 20 * 20, rtol=1e-4)   # DC of the resized image


@pytest.mark.parametrize("images,b,match", [
    (np.zeros((2, 8, 8)), 1, "N, H, W, 3"),
    (np.zeros((0, 8, 8, 3), np.uint8), 1, "at least one"),
    (np.full((1, 8, 8, 3), np.nan), 1, "NaN"),
    (np.full((1, 8, 8, 3), 300.0), 1, r"\[0, 255\]"),
    (np.zeros((1, 8, 8, 3), np.int16), 1, "uint8"),
    (np.zeros((1, 8, 8, 3), np.uint8), -1, "b must"),
    (np.zeros((1, 4, 4, 3), np.uint8), 2, "does not fit"),
])
def test_bad_inputs_are_refused(images, b, match):
    with pytest.raises(ValueError, match=match):
        extract_style(images, b)


def test_restyling_imposes_the_style_and_keeps_the_phase():
    rng = np.random.default_rng(1)
    base = np.clip(rng.normal(120, 25, (3, 32, 32, 3)), 0, 255).astype(np.uint8)
    target = np.clip(rng.normal(90, 25, (4, 32, 32, 3)) * np.array([0.7, 0.9, 1.2]), 0, 255).astype(np.uint8)
    style = extract_style(target, 1)
    out = apply_style(base, np.repeat(style[None], 3, axis=0))
    assert out.dtype == np.uint8 and out.shape == base.shape
    # every restyled image now carries the style in its window (up to rounding to uint8 and
    # clipping, small against the DC term), and its DC term exactly up to rounding
    got = image_styles(out, 1)
    np.testing.assert_allclose(got, np.repeat(style[None], 3, 0), atol=2e-3 * style.max())
    np.testing.assert_allclose(got[:, :, 1, 1], np.repeat(style[None, :, 1, 1], 3, 0), rtol=3e-3)
    assert not np.allclose(image_styles(base, 1), got, atol=2e-3 * style.max())
    # outside the window the phase is the original one
    f0, f1 = np.fft.fft2(base.astype(float), axes=(1, 2)), np.fft.fft2(out.astype(float), axes=(1, 2))
    k = (slice(None), 5, 7, 0)
    assert np.abs(np.angle(f0[k] * np.conj(f1[k]))).max() < 0.05
    with pytest.raises(ValueError, match="non-negative"):
        apply_style(base, -np.ones((3, 3, 3, 3)))
    with pytest.raises(ValueError, match=r"\(N, 3"):
        apply_style(base, np.ones((2, 3, 3, 3)))


def roundtrip(body, tensors):
    ref = M.TaskRef("job", 1, "t")
    return decode(encode(M.result_message("dev", ref, "ladd.style", body, tensors)))


def test_style_payload_roundtrip_and_validation():
    style = extract_style(np.random.default_rng(2).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8), 1)
    parsed = parse_style(roundtrip(*encode_style(style, 3, 1)), b=1, image_size=16)
    np.testing.assert_array_equal(parsed.style, style)
    assert parsed.n == 3
    body, tensors = encode_style(style, 3, 1)
    with pytest.raises(EnvelopeError, match="b=1"):
        parse_style(roundtrip(body, tensors), b=2, image_size=16)
    with pytest.raises(EnvelopeError, match="amplitudes"):
        parse_style(roundtrip(body, {"style": style * 1e3}), b=1, image_size=16)    # above 255·S²
    with pytest.raises(EnvelopeError, match="NaN"):
        parse_style(roundtrip(body, {"style": np.full_like(style, np.nan)}), b=1, image_size=16)
    with pytest.raises(EnvelopeError, match="shape"):
        parse_style(roundtrip(body, {"style": style[:, :2]}), b=1, image_size=16)
    with pytest.raises(EnvelopeError, match="dtype"):
        parse_style(roundtrip(body, {"style": style.astype(np.float64)}), b=1, image_size=16)
    with pytest.raises(EnvelopeError, match="n=0"):
        parse_style(roundtrip({**body, "n": 0}, tensors), b=1, image_size=16)
    with pytest.raises(EnvelopeError, match="unexpected"):
        parse_style(roundtrip(body, {**tensors, "extra": style}), b=1, image_size=16)
    with pytest.raises(ValueError, match="non-negative"):
        encode_style(-style, 3, 1)


def test_large_styles_are_transformed_in_batches_of_bounded_pixels(monkeypatch):
    """The device review's finding: a ladd.style task's image size (up to 1,024 px) set what every
    FFT batch of 256 images held, tens of GB at the largest size. A batch now holds at most
    MAX_STYLE_BATCH_PIXELS pixels (one image at the largest size), with the same styles."""
    import tracemalloc

    from edge_client import style

    images = np.random.default_rng(3).integers(0, 256, (24, 16, 16, 3), dtype=np.uint8)
    expected = image_styles(images, 1)                              # 16 px: one batch, as before
    np.testing.assert_allclose(expected.mean(0), reference_style(images, 1), rtol=1e-9)

    def peak_bytes(fn):
        tracemalloc.start()
        try:
            fn()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    size = (128, 128)
    whole = peak_bytes(lambda: image_styles(images, 1, size))      # 24 x 16,384 pixels < the bound: one batch
    monkeypatch.setattr(style, "MAX_STYLE_BATCH_PIXELS", 4 * 128 * 128)
    batched = peak_bytes(lambda: image_styles(images, 1, size))
    assert batched < whole / 2, (batched, whole)                    # 6 batches of 4 images instead of 1 of 24
    np.testing.assert_allclose(image_styles(images, 1, size), image_styles(images, 1, size, batch=1), rtol=1e-12)
    assert style.MAX_STYLE_BATCH_PIXELS * 200 < 2 ** 30             # one batch at the bound stays under 1 GiB
