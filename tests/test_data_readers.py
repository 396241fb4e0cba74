"""IDX and image-folder readers, checked against files this test writes itself.

The IDX writer here packs headers with ``struct`` and payloads with numpy big-endian
dtypes; the PNG writer applies all five PNG row filters by hand and compresses with zlib;
PPM/PGM are raw headers plus bytes. So a reader that mis-handles byte order, gzip
detection, filters, or grayscale/alpha conversion fails against the arrays written.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from edge_client.data import (
    FASHION_MNIST_DIR,
    IdxFormatError,
    load_fashion_mnist,
    load_idx_dataset,
    load_image_folder,
    read_idx,
)

IDX_CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}


# ---------------------------------------------------------------- IDX fixtures

def idx_bytes(array: np.ndarray) -> bytes:
    code = IDX_CODES[array.dtype.type]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, compress: bool = False) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def random_array(dtype, shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype) * 1e3
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("dtype", list(IDX_CODES), ids=lambda t: t.__name__)
def test_idx_round_trip_every_dtype(tmp_path, dtype, compress):
    array = random_array(dtype, (3, 4, 5))
    result = read_idx(write_idx(tmp_path / "a.idx", array, compress))
    assert result.dtype == np.dtype(dtype)  # native order, not big-endian
    assert result.dtype.isnative
    np.testing.assert_array_equal(result, array)
    result[0, 0, 0] = 0  # caller gets a writable copy


def test_idx_compression_detected_by_magic_not_extension(tmp_path):
    array = random_array(np.int16, (7,))
    gz_named_plain = write_idx(tmp_path / "data.gz", array, compress=False)
    plain_named_gz = write_idx(tmp_path / "data-idx1-ubyte", array, compress=True)
    np.testing.assert_array_equal(read_idx(gz_named_plain), array)
    np.testing.assert_array_equal(read_idx(plain_named_gz), array)


def test_idx_one_and_four_dimensions(tmp_path):
    for shape in [(11,), (2, 3, 4, 3)]:
        array = random_array(np.uint8, shape)
        np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "x", array)), array)


def _corruptions():
    good = idx_bytes(random_array(np.int32, (4, 6)))
    return {
        "bad magic": b"\x01" + good[1:],
        "unknown dtype code": good[:2] + b"\x0a" + good[3:],
        "zero dims": b"\x00\x00\x08\x00",
        "truncated magic": good[:3],
        "truncated dims": good[:6],
        "truncated payload": good[:-1],
        "oversized payload": good + b"\x00",
        "empty file": b"",
    }


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("name", list(_corruptions()))
def test_idx_malformed_files_raise_clear_error(tmp_path, name, compress):
    data = _corruptions()[name]
    path = tmp_path / "bad"
    path.write_bytes(gzip.compress(data) if compress else data)
    with pytest.raises(IdxFormatError):
        read_idx(path)


def test_idx_truncated_gzip_stream(tmp_path):
    compressed = gzip.compress(idx_bytes(random_array(np.float32, (50, 50))))
    path = tmp_path / "cut.gz"
    path.write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(IdxFormatError, match="gzip"):
        read_idx(path)


def test_idx_error_is_a_value_error():
    assert issubclass(IdxFormatError, ValueError)


def test_load_idx_dataset_pair(tmp_path):
    images = random_array(np.uint8, (9, 5, 4))
    labels = random_array(np.uint8, (9,)) % 10
    x, y = load_idx_dataset(write_idx(tmp_path / "i", images, True), write_idx(tmp_path / "l", labels))
    np.testing.assert_array_equal(x, images)
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, labels.astype(np.int64))


@pytest.mark.parametrize(
    "images, labels, message",
    [
        (random_array(np.uint8, (9, 5, 4)), random_array(np.uint8, (8,)), "9 images but .* 8 labels"),
        (random_array(np.int16, (9, 5, 4)), random_array(np.uint8, (9,)), "uint8 images"),
        (random_array(np.uint8, (9, 20)), random_array(np.uint8, (9,)), "uint8 images"),
        (random_array(np.uint8, (9, 5, 4)), random_array(np.uint8, (9, 1)), "integer labels"),
        (random_array(np.uint8, (9, 5, 4)), random_array(np.float32, (9,)), "integer labels"),
        (random_array(np.uint8, (2, 0, 28)), random_array(np.uint8, (2,)), r"shape \(0, 28\) hold no pixels"),
        (random_array(np.uint8, (2, 28, 0)), random_array(np.uint8, (2,)), r"shape \(28, 0\) hold no pixels"),
        (random_array(np.uint8, (3, 5, 4)), np.array([2, -1, 0], np.int8), "negative label -1"),
        (random_array(np.uint8, (3, 5, 4)), np.array([2, 0, -300], np.int16), "negative label -300"),
        (random_array(np.uint8, (3, 5, 4)), np.array([-7, 0, 1], np.int32), "negative label -7"),
    ],
    ids=["count mismatch", "image dtype", "image ndim", "label ndim", "label dtype", "zero-height images",
         "zero-width images", "negative i1 label", "negative i2 label", "negative i4 label"],
)
def test_load_idx_dataset_rejects_inconsistent_pairs(tmp_path, images, labels, message):
    with pytest.raises(IdxFormatError, match=message):
        load_idx_dataset(write_idx(tmp_path / "i", images), write_idx(tmp_path / "l", labels))


@pytest.mark.skipif(
    not FASHION_MNIST_DIR.is_dir(),
    reason=f"{FASHION_MNIST_DIR} absent: install it with `apt-get install dataset-fashion-mnist`",
)
@pytest.mark.parametrize("split, n, stem", [("train", 60000, "train"), ("test", 10000, "t10k")])
def test_fashion_mnist_splits(split, n, stem):
    images, labels = load_fashion_mnist(split)
    assert images.shape == (n, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (n,) and labels.dtype == np.int64
    # Fashion-MNIST is class-balanced: each of the 10 labels is exactly a tenth of the split.
    np.testing.assert_array_equal(np.bincount(labels, minlength=10), np.full(10, n // 10))
    # Independent parse of the same files: skip the fixed 16/8-byte headers.
    with gzip.open(FASHION_MNIST_DIR / f"{stem}-images-idx3-ubyte.gz") as f:
        raw_images = np.frombuffer(f.read()[16:], np.uint8).reshape(n, 28, 28)
    with gzip.open(FASHION_MNIST_DIR / f"{stem}-labels-idx1-ubyte.gz") as f:
        raw_labels = np.frombuffer(f.read()[8:], np.uint8)
    np.testing.assert_array_equal(images, raw_images)
    np.testing.assert_array_equal(labels, raw_labels)


def test_fashion_mnist_missing_directory_names_the_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist("train", root=tmp_path)


def test_fashion_mnist_unknown_split():
    with pytest.raises(ValueError, match="split"):
        load_fashion_mnist("validation")


def test_fashion_mnist_reads_plain_copies(tmp_path):
    images = random_array(np.uint8, (3, 28, 28))
    labels = np.array([0, 9, 4], dtype=np.uint8)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", images)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels)
    x, y = load_fashion_mnist("test", root=tmp_path)
    np.testing.assert_array_equal(x, images)
    np.testing.assert_array_equal(y, labels)


def test_fashion_mnist_is_read_once_per_process_until_its_files_change(tmp_path, monkeypatch):
    """A second load of the same, unchanged files reads nothing (inflating the training images is
    ~0.25 CPU-s) and still hands each caller its own writable arrays; a changed file is read
    again; ``keep=False`` always reads."""
    import os

    from edge_client.data import idx

    reads = []
    real_read_idx = idx.read_idx
    monkeypatch.setattr(idx, "read_idx", lambda path, *a: reads.append(Path(path).name) or real_read_idx(path, *a))
    images, labels = random_array(np.uint8, (4, 28, 28)), np.array([1, 2, 3, 4], dtype=np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte", images, compress=True)
    write_idx(tmp_path / "train-labels-idx1-ubyte", labels)
    first, again = load_fashion_mnist("train", root=tmp_path), load_fashion_mnist("train", root=tmp_path)
    assert reads == ["train-images-idx3-ubyte", "train-labels-idx1-ubyte"]      # the second load read no file
    for x, y in (first, again):
        np.testing.assert_array_equal(x, images)
        np.testing.assert_array_equal(y, labels)
    first[0][:] = 0                                  # each caller's own writable copy
    np.testing.assert_array_equal(load_fashion_mnist("train", root=tmp_path)[0], images)

    changed = images[::-1].copy()                    # same size: the file's mtime tells them apart
    path = write_idx(tmp_path / "train-images-idx3-ubyte", changed, compress=True)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    np.testing.assert_array_equal(load_fashion_mnist("train", root=tmp_path)[0], changed)
    assert len(reads) == 4
    np.testing.assert_array_equal(load_fashion_mnist("train", root=tmp_path, keep=False)[0], changed)
    assert len(reads) == 6


# ---------------------------------------------------------------- image fixtures

def _paeth(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    p = a + b - c
    pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
    return np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))


def png_bytes(array: np.ndarray) -> bytes:
    """Encode uint8 (H, W) gray, (H, W, 3) RGB or (H, W, 4) RGBA, cycling filters 0..4 per row."""
    if array.ndim == 2:
        array = array[:, :, None]
    height, width, channels = array.shape
    color_type = {1: 0, 3: 2, 4: 6}[channels]
    rows = array.reshape(height, width * channels).astype(np.int32)
    raw = bytearray()
    for y in range(height):
        filter_type = y % 5
        row = rows[y]
        up = rows[y - 1] if y > 0 else np.zeros_like(row)
        left = np.concatenate([np.zeros(channels, np.int32), row[:-channels]])
        up_left = np.concatenate([np.zeros(channels, np.int32), up[:-channels]])
        predictor = [np.zeros_like(row), left, up, (left + up) // 2, _paeth(left, up, up_left)][filter_type]
        raw.append(filter_type)
        raw += ((row - predictor) % 256).astype(np.uint8).tobytes()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(raw)))
            + chunk(b"IEND", b""))


def pnm_bytes(array: np.ndarray) -> bytes:
    magic = b"P5" if array.ndim == 2 else b"P6"
    return magic + f"\n{array.shape[1]} {array.shape[0]}\n255\n".encode() + array.astype(np.uint8).tobytes()


def rgb_of(array: np.ndarray) -> np.ndarray:
    """What the reader must return: gray replicated to 3 channels, alpha dropped."""
    if array.ndim == 2:
        return np.repeat(array[:, :, None], 3, axis=2)
    return array[:, :, :3]


def pixels(shape, seed) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


@pytest.fixture
def folder(tmp_path):
    """bird: 2 PGM; cat: RGB + gray + RGBA PNGs; dog: 1 PPM. All 6x5 (H x W)."""
    written = {
        "bird/b1.pgm": pixels((6, 5), 1),
        "bird/a0.pgm": pixels((6, 5), 2),
        "cat/x.png": pixels((6, 5, 3), 3),
        "cat/y.PNG": pixels((6, 5), 4),
        "cat/z.png": pixels((6, 5, 4), 5),
        "dog/only.ppm": pixels((6, 5, 3), 6),
    }
    for name, array in written.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(png_bytes(array) if path.suffix.lower() == ".png" else pnm_bytes(array))
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    (tmp_path / "cat" / ".hidden.png").write_bytes(b"junk")
    return tmp_path, written


def test_png_writer_filters_cover_all_five_types():
    # Sanity of the fixture itself: 5+ rows means every filter type 0..4 is used.
    decoded = zlib.decompress(png_bytes(pixels((7, 3, 3), 0))[33 + 8:][:-12 - 4])
    filter_bytes = [decoded[y * (1 + 9)] for y in range(7)]
    assert sorted(set(filter_bytes)) == [0, 1, 2, 3, 4]


def test_image_folder_reads_every_format_in_sorted_order(folder):
    root, written = folder
    images, labels, classes = load_image_folder(root)
    assert classes == ["bird", "cat", "dog"]
    expected_order = ["bird/a0.pgm", "bird/b1.pgm", "cat/x.png", "cat/y.PNG", "cat/z.png", "dog/only.ppm"]
    assert images.shape == (6, 6, 5, 3) and images.dtype == np.uint8
    np.testing.assert_array_equal(labels, [0, 0, 1, 1, 1, 2])
    assert labels.dtype == np.int64
    for got, name in zip(images, expected_order):
        np.testing.assert_array_equal(got, rgb_of(written[name]), err_msg=name)


def test_image_folder_explicit_classes_set_ids_and_filter(folder):
    root, written = folder
    images, labels, classes = load_image_folder(root, classes=["dog", "cat"])
    assert classes == ["dog", "cat"]
    np.testing.assert_array_equal(labels, [0, 1, 1, 1])
    np.testing.assert_array_equal(images[0], rgb_of(written["dog/only.ppm"]))


def test_image_folder_empty_listed_class_keeps_its_id(folder):
    root, _ = folder
    (root / "eel").mkdir()
    _, labels, classes = load_image_folder(root, classes=["eel", "dog"])
    assert classes == ["eel", "dog"]
    np.testing.assert_array_equal(labels, [1])


def test_image_folder_resize_is_height_width(folder):
    root, written = folder
    images, _, _ = load_image_folder(root, size=(3, 8))
    assert images.shape == (6, 3, 8, 3)
    flat = np.full((6, 5, 3), 77, np.uint8)
    (root / "dog" / "only.ppm").write_bytes(pnm_bytes(flat))
    images, labels, _ = load_image_folder(root, size=(3, 8))
    # A constant image stays constant under any interpolating resize.
    np.testing.assert_array_equal(images[labels == 2], 77)


def test_image_folder_reads_jpeg_approximately(tmp_path):
    pil = pytest.importorskip("PIL.Image")
    smooth = np.clip(np.add.outer(np.arange(16) * 8, np.arange(16) * 4), 0, 255).astype(np.uint8)
    rgb = np.stack([smooth, smooth.T, 255 - smooth], axis=2)
    (tmp_path / "a").mkdir()
    pil.fromarray(rgb).save(tmp_path / "a" / "img.jpg", quality=95)
    images, _, _ = load_image_folder(tmp_path)
    assert np.abs(images[0].astype(int) - rgb).mean() < 3  # lossy codec: close, not equal


def test_image_folder_mixed_sizes_need_size(folder):
    root, _ = folder
    (root / "dog" / "big.ppm").write_bytes(pnm_bytes(pixels((9, 9, 3), 7)))
    with pytest.raises(ValueError, match="size="):
        load_image_folder(root)
    assert load_image_folder(root, size=(6, 5))[0].shape == (7, 6, 5, 3)


@pytest.mark.parametrize("content", [b"garbage bytes", png_bytes(pixels((6, 5, 3), 0))[:60]],
                         ids=["not an image", "truncated png"])
def test_image_folder_corrupt_file_names_it(folder, content):
    root, _ = folder
    (root / "dog" / "broken.png").write_bytes(content)
    with pytest.raises(ValueError, match="broken.png"):
        load_image_folder(root)


def test_image_folder_bad_arguments(tmp_path, folder):
    root, _ = folder
    with pytest.raises(FileNotFoundError):
        load_image_folder(tmp_path / "nope")
    with pytest.raises(ValueError, match="none of the declared classes"):
        load_image_folder(root, classes=["fish", "eel"])
    with pytest.raises(ValueError, match="duplicates"):
        load_image_folder(root, classes=["cat", "cat"])
    with pytest.raises(ValueError, match="size"):
        load_image_folder(root, size=(0, 5))
    with pytest.raises(ValueError, match="size"):
        load_image_folder(root, size=(4,))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no class subfolders"):
        load_image_folder(empty)
    (empty / "c").mkdir()
    with pytest.raises(ValueError, match="no images"):
        load_image_folder(empty)


def test_an_image_folder_may_hold_any_subset_of_the_declared_classes(folder):
    """A device with 2 of the job's 4 classes: ids follow the declared list, not the folders present."""
    root, _ = folder
    present = sorted(p.name for p in root.iterdir() if p.is_dir())
    declared = ["ant", present[0], "bee", *present[1:]]
    images, labels, names = load_image_folder(root, classes=declared)
    own, _, _ = load_image_folder(root)                     # folder-name ids for comparison
    assert names == declared and len(images) == len(own)
    assert set(labels.tolist()) == {declared.index(n) for n in present}
    assert 0 not in labels and 2 not in labels               # declared classes with no images keep their ids


@pytest.mark.parametrize("dims", [(0xFFFFFFFF,) * 3, (1 << 20, 1 << 20), (1 << 12, 1 << 12)],
                         ids=["overflow", "1TiB", "16MiB-in-64-bytes"])
@pytest.mark.parametrize("compressed", [False, True], ids=["raw", "gzip"])
def test_an_idx_header_declaring_more_than_there_is_or_may_be_is_a_format_error(tmp_path, dims, compressed):
    """A review's finding: the header's dims went straight into one read(), which allocated what
    they declared (a 16-byte file: OverflowError or MemoryError, not IdxFormatError)."""
    import gzip

    from edge_client.data.idx import IdxFormatError, read_idx

    header = bytes([0, 0, 0x08, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)
    path = tmp_path / "bomb-idx3-ubyte"
    path.write_bytes(gzip.compress(header + b"\0" * 64) if compressed else header + b"\0" * 64)
    with pytest.raises(IdxFormatError):
        read_idx(path, max_bytes=1 << 20 if dims == (1 << 12, 1 << 12) and compressed else 1 << 30)


@pytest.mark.parametrize("dtype", [np.uint8, np.int32], ids=["u1", "i4 (swapped)"])
def test_an_idx_payload_is_held_once_while_read(tmp_path, dtype):
    """A review's finding: a ~1 MB gzip may inflate to the 1 GB payload cap, and the reader held the
    inflated blocks, their join and a native-order copy: about three times the payload at its peak."""
    import tracemalloc

    from edge_client.data.idx import _BLOCK

    array = np.zeros((256 // np.dtype(dtype).itemsize, 256, 256), dtype)      # 16 MiB
    array[::7, 3, 5] = 201                               # not all zeros: the values must come back
    path = write_idx(tmp_path / "big-idx3", array, compress=True)
    tracemalloc.start()
    try:
        result = read_idx(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(result, array)
    assert result.dtype.isnative and result.flags.writeable
    # beyond the payload, only the gzip reader's buffers for one block (about three blocks)
    overhead = peak - array.nbytes
    assert overhead < 4 * _BLOCK, f"peak {peak / array.nbytes:.2f}x the {array.nbytes}-byte payload"
