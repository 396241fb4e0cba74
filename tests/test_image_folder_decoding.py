"""How the image-folder reader decodes a device's files (a review's findings): only as the format
the suffix names, only up to MAX_IMAGE_PIXELS judged from the header, 16-bit grayscale to its high
byte (it was clipped to white), upright as the EXIF orientation says (a portrait phone photo was
read lying on its side). Small synthetic files; the references are numpy arrays."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from edge_client.data import image_folder
from edge_client.data.image_folder import load_image_folder


def saved(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def folder_with(tmp_path, name: str, data: bytes):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / name).write_bytes(data)
    return tmp_path


@pytest.mark.parametrize("name, fmt", [("a.png", "TIFF"), ("a.jpg", "GIF"), ("a.png", "ICO"), ("a.pgm", "PNG")])
def test_a_file_is_decoded_only_as_the_format_its_suffix_names(tmp_path, name, fmt):
    """Image.open tried every format Pillow knows: a ".png" holding PostScript went to Ghostscript."""
    root = folder_with(tmp_path, name, saved(Image.new("RGB", (16, 16), (9, 8, 7)), fmt))
    with pytest.raises(ValueError, match=name):
        load_image_folder(root)


def png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_an_image_declaring_more_than_max_image_pixels_is_refused_from_its_header(tmp_path, monkeypatch):
    """10000x8000 (80 M pixels) is under Pillow's error bound (179 M; it only warns) and was decoded."""
    root = folder_with(tmp_path, "big.png", png_header_only(10_000, 8_000))
    with pytest.raises(ValueError, match=r"big\.png: 10000x8000 is more than the .* pixels an image may have"):
        load_image_folder(root)

    monkeypatch.setattr(image_folder, "MAX_IMAGE_PIXELS", 100, raising=False)
    (root / "cat" / "big.png").write_bytes(saved(Image.new("RGB", (11, 10)), "PNG"))
    with pytest.raises(ValueError, match="11x10"):
        load_image_folder(root)
    (root / "cat" / "big.png").write_bytes(saved(Image.new("RGB", (10, 10), (1, 2, 3)), "PNG"))
    assert load_image_folder(root)[0].shape == (1, 10, 10, 3)


GRAY16 = np.array([[0, 255, 256, 4000], [32768, 65280, 65534, 65535]], np.uint16)


@pytest.mark.parametrize("name, fmt", [("g.png", "PNG"), ("g.pgm", "PPM")])
def test_16_bit_grayscale_keeps_its_high_byte(tmp_path, name, fmt):
    root = folder_with(tmp_path, name, saved(Image.fromarray(GRAY16), fmt))
    images, _, _ = load_image_folder(root)
    expected = (GRAY16 >> 8).astype(np.uint8)
    np.testing.assert_array_equal(images[0], np.repeat(expected[..., None], 3, axis=-1))


def test_a_photo_is_read_upright_as_its_exif_orientation_says(tmp_path):
    """Orientation 6: the stored pixels are to be turned 90 degrees clockwise to be seen."""
    stored = np.zeros((16, 32, 3), np.uint8)
    stored[:, :16] = (255, 0, 0)                 # left half red, right half blue
    stored[:, 16:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    root = folder_with(tmp_path, "p.jpg", saved(Image.fromarray(stored), "JPEG", quality=95, exif=exif.tobytes()))
    images, _, _ = load_image_folder(root)
    upright = np.rot90(stored, k=-1)             # clockwise: the left half on top
    assert images[0].shape == upright.shape == (32, 16, 3)
    away_from_the_edge = np.r_[0:12, 20:32]        # (JPEG blurs colour across the red-blue edge)
    assert np.abs(images[0][away_from_the_edge].astype(int) - upright[away_from_the_edge]).max() <= 8
