"""An image folder's memory (a review's findings): the whole folder is held decoded, so
``load_image_folder`` refuses one that would decode to more than its cap before decoding anything,
and decodes into one preallocated array (a list then np.stack held everything twice at the peak);
``fedfleet device`` turns a folder of mixed sizes or too many bytes into one line naming its own
options (``--image-size``, ``--image-memory-mb``), and with ``--image-size`` loads a folder of
portrait and landscape photos. References: the images as written, resized by Pillow alone."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from edge_client.data import image_folder
from edge_client.data.image_folder import ImageFolderTooLargeError, MixedImageSizesError, load_image_folder

Image = pytest.importorskip("PIL.Image")


def write_folder(root, shapes_by_class):
    rng = np.random.default_rng(0)
    written = {}
    for name, shapes in shapes_by_class.items():
        (root / name).mkdir(parents=True)
        for i, (h, w) in enumerate(shapes):
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i:03d}.png")
            written[f"{name}/{i:03d}.png"] = pixels
    return written


def test_a_folder_over_the_cap_is_refused_before_any_image_is_decoded(tmp_path, monkeypatch):
    write_folder(tmp_path, {"cat": [(20, 30)] * 3, "dog": [(20, 30)] * 2})     # 5 x 1,800 bytes decoded
    decoded = []
    real_decode = image_folder._decode_rgb
    monkeypatch.setattr(image_folder, "_decode_rgb", lambda *a: decoded.append(a[1]) or real_decode(*a))
    with pytest.raises(ImageFolderTooLargeError, match=rf"{tmp_path}.*more than the") as refused:
        load_image_folder(tmp_path, max_bytes=5 * 1800 - 1)
    assert "9,000" not in str(refused.value) and decoded == []
    assert load_image_folder(tmp_path, max_bytes=5 * 1800)[0].shape == (5, 20, 30, 3)      # at the cap: loads
    # with a size, the bytes at that size count: 5 x 4 x 6 x 3 = 360
    assert load_image_folder(tmp_path, size=(4, 6), max_bytes=360)[0].shape == (5, 4, 6, 3)
    with pytest.raises(ImageFolderTooLargeError):
        load_image_folder(tmp_path, size=(4, 6), max_bytes=359)


def test_the_default_cap_refuses_photos_no_device_holds(tmp_path, monkeypatch):
    write_folder(tmp_path, {"cat": [(10, 10)]})
    monkeypatch.setattr(image_folder, "_declared_size", lambda Image, path: (200_000, 10_000))   # 6 GB of RGB
    with pytest.raises(ImageFolderTooLargeError, match="4,096 MiB cap"):
        load_image_folder(tmp_path)


def test_images_are_decoded_into_one_array_not_held_twice(tmp_path):
    written = write_folder(tmp_path, {"cat": [(100, 150)] * 32})     # 32 x 45 kB decoded
    tracemalloc.start()
    try:
        images, labels, _ = load_image_folder(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for i, got in enumerate(images):
        np.testing.assert_array_equal(got, written[f"cat/{i:03d}.png"])
    assert peak < 1.5 * images.nbytes, f"peak {peak:,} bytes for {images.nbytes:,} bytes of images"


def device_args(folder, **options):
    return SimpleNamespace(idx=None, image_folder=folder, classes="land,portrait", threads=None, runtime="eager",
                           **{"image_size": None, "image_memory_mb": 4096.0, **options})


def test_the_device_names_its_option_for_mixed_orientations_and_loads_them_with_it(tmp_path):
    from fedfleet.device import _local_images
    from fedfleet.errors import UserError

    written = write_folder(tmp_path, {"land": [(30, 40)], "portrait": [(40, 30)]})
    with pytest.raises(MixedImageSizesError):
        load_image_folder(tmp_path)
    with pytest.raises(UserError, match="--image-size PIXELS") as refused:
        _local_images(device_args(tmp_path))
    assert "size=(" not in str(refused.value)         # no Python argument the command does not have

    images, labels = _local_images(device_args(tmp_path, image_size=16))
    np.testing.assert_array_equal(labels, [0, 1])
    for got, name in zip(images, ["land/000.png", "portrait/000.png"]):
        expected = np.asarray(Image.fromarray(written[name]).resize((16, 16), Image.Resampling.BILINEAR))
        np.testing.assert_array_equal(got, expected)


def test_the_device_refuses_a_folder_over_its_memory_option_naming_it(tmp_path):
    from fedfleet.device import IMAGE_FOLDER_MB, _local_images
    from fedfleet.errors import UserError

    assert IMAGE_FOLDER_MB * 2**20 == image_folder.MAX_FOLDER_BYTES       # the flag's default is the reader's
    write_folder(tmp_path, {"land": [(600, 600)] * 2})                    # 2.1 MB decoded
    with pytest.raises(UserError, match=r"--image-memory-mb.*--image-size") as refused:
        _local_images(device_args(tmp_path, image_memory_mb=1.0))
    assert str(tmp_path) in str(refused.value)
    assert _local_images(device_args(tmp_path, image_memory_mb=1.0, image_size=224))[0].shape == (2, 224, 224, 3)
