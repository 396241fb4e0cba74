"""The device's feature cache against files that are not what it wrote (a review's findings): a
cache file whose header declares more than the file holds, a FIFO or a folder at a cache file's
name, a cache folder that cannot be written, a file of the right size with a flipped byte or
zeroed after a crash. Each is a miss (or stays uncached): the extraction
returns the features the model computes, without a large allocation, a hang or an error.
Torch-free: the "model" is a small numpy function, and the reference the same extractor without
a cache."""

from __future__ import annotations

import io
import os
import threading
import tracemalloc

import numpy as np
import pytest

from edge_client.features import FeatureExtractor

DIM = 4


def pixel_features(batch: np.ndarray) -> np.ndarray:
    """A deterministic stand-in for a backbone: each image's first DIM normalised values."""
    return batch.reshape(len(batch), -1)[:, :DIM].astype(np.float32)


def extractor(cache_dir=None) -> FeatureExtractor:
    return FeatureExtractor(pixel_features, image_size=8, mean=(0.5,) * 3, std=(0.25,) * 3, feature_dim=DIM,
                            cache_dir=cache_dir, cache_key="test-model" if cache_dir is not None else "")


IMAGES = np.random.default_rng(0).integers(0, 256, (3, 5, 5), dtype=np.uint8)
EXPECTED = extractor().extract(IMAGES)          # no cache: what the model computes


def cache_name(tmp_path):
    return extractor(tmp_path)._cache_file(IMAGES)


def npy_header(shape) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return out.getvalue()


@pytest.mark.parametrize("shape", [(1 << 40, DIM), (len(IMAGES), 1 << 24)], ids=["2^40 rows", "2^24 columns"])
def test_a_cache_header_declaring_more_than_the_file_holds_is_a_miss_read_without_its_allocation(tmp_path, shape):
    """A 100-byte file declared 16 TiB (MemoryError out of every extraction of these images) or
    200 MB (allocated, then found short)."""
    cache_name(tmp_path).write_bytes(npy_header(shape) + b"\0" * 16)
    tracemalloc.start()
    try:
        features = extractor(tmp_path).extract(IMAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(features, EXPECTED)
    assert peak < 8 << 20, f"{peak:,} bytes allocated to read a cache file of {16 + len(npy_header(shape))}"
    np.testing.assert_array_equal(np.load(cache_name(tmp_path)), EXPECTED)      # rewritten whole


def test_a_fifo_at_a_cache_files_name_is_a_miss_not_a_hang(tmp_path):
    fifo = cache_name(tmp_path)
    os.mkfifo(fifo)
    result = []
    worker = threading.Thread(target=lambda: result.append(extractor(tmp_path).extract(IMAGES)), daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():           # release the reader blocked in open() before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5)
        pytest.fail("the extraction waited for a writer on the FIFO at its cache file's name")
    np.testing.assert_array_equal(result[0], EXPECTED)


def test_a_cache_that_cannot_be_written_leaves_the_features_uncached(tmp_path):
    """A folder at the cache file's name (as a full disk or a read-only cache folder would): the
    extraction failed after computing its features, and so did every later one of these images."""
    cache_name(tmp_path).mkdir()
    cached = extractor(tmp_path)
    np.testing.assert_array_equal(cached.extract(IMAGES), EXPECTED)
    np.testing.assert_array_equal(cached.extract(IMAGES), EXPECTED)
    assert sorted(p.name for p in tmp_path.iterdir()) == [cache_name(tmp_path).name]   # no temporary file left

    blocked = tmp_path / "not-a-folder"
    blocked.write_bytes(b"")
    np.testing.assert_array_equal(extractor(blocked / "cache").extract(IMAGES), EXPECTED)


def _damaged_in_place(path, how):
    data = bytearray(path.read_bytes())
    if how == "flipped byte":
        data[-40] ^= 0x01               # a bit in the last feature value: still a finite float32
    else:
        data[128:] = bytes(len(data) - 128)     # the data zero-filled, the header kept (an unsynced crash)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flipped byte", "zero-filled"])
def test_a_cache_file_damaged_at_its_size_is_recomputed_not_used(tmp_path, how):
    """A file of the right size whose bytes changed on disk loaded as valid features (Fed3R's
    statistics then summed the wrong ones): its checksum no longer matches, so it is a miss."""
    calls = []
    cached = FeatureExtractor(lambda batch: calls.append(len(batch)) or pixel_features(batch), image_size=8,
                              mean=(0.5,) * 3, std=(0.25,) * 3, feature_dim=DIM, cache_dir=tmp_path,
                              cache_key="test-model")
    np.testing.assert_array_equal(cached.extract(IMAGES), EXPECTED)
    size = cache_name(tmp_path).stat().st_size
    _damaged_in_place(cache_name(tmp_path), how)
    assert cache_name(tmp_path).stat().st_size == size
    calls.clear()
    np.testing.assert_array_equal(cached.extract(IMAGES), EXPECTED)
    assert calls, "the damaged cache file was used"
    calls.clear()
    np.testing.assert_array_equal(cached.extract(IMAGES), EXPECTED)     # rewritten whole: a hit again
    assert not calls
    assert [p.name for p in tmp_path.iterdir()] == [cache_name(tmp_path).name]     # no temporary file left
