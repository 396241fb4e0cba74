"""Reader for the IDX array format (MNIST, Fashion-MNIST), plain or gzip-compressed.

An IDX file is a 4-byte magic ``00 00 <dtype code> <ndim>``, then ``ndim`` big-endian
uint32 dimension sizes, then exactly ``prod(dims)`` big-endian items. Compression is
detected from the gzip magic bytes ``1f 8b`` rather than the file name, because
mirrors of these datasets ship both ``*.gz`` and already-decompressed files under
either name.

The reader streams: it parses the header first and then reads exactly the payload the
header promises plus one probe byte, so a truncated file, trailing garbage, or a gzip
bomb is detected without decompressing more than the header says is there.
"""

from __future__ import annotations

import errno
import gzip
import math
import os
import threading
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from protocols.regular_file import open_regular

GZIP_MAGIC = b"\x1f\x8b"

# IDX dtype code -> big-endian numpy dtype of the payload items.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class IdxFormatError(ValueError):
    """The bytes are not a well-formed IDX file (bad magic, bad dims, wrong payload length)."""


MAX_IDX_BYTES = 1 << 30         # a payload larger than this is refused (Fashion-MNIST's largest: 47 MB)
_BLOCK = 1 << 20


def _read_into(stream: BinaryIO, buffer: memoryview, path: Path, what: str) -> None:
    """Fill ``buffer`` from ``stream``; IdxFormatError if the stream ends first."""
    # in blocks: GzipFile.readinto reads a whole request into a temporary bytes object first
    got = 0
    while got < len(buffer):
        n = stream.readinto(buffer[got:got + _BLOCK])
        if not n:
            raise IdxFormatError(f"{path}: truncated {what}: expected {len(buffer)} bytes, got {got}")
        got += n


def _read_exactly(stream: BinaryIO, n_bytes: int, path: Path, what: str) -> bytes:
    data = bytearray(n_bytes)        # only the header's few bytes: the payload is read by _read_into
    _read_into(stream, memoryview(data), path, what)
    return bytes(data)


def _parse(stream: BinaryIO, path: Path, max_bytes: int) -> np.ndarray:
    magic = _read_exactly(stream, 4, path, "magic number")
    if magic[0] != 0 or magic[1] != 0:
        raise IdxFormatError(
            f"{path}: bad IDX magic {magic.hex()}: the first two bytes must be 00 00"
        )
    dtype_code, ndim = magic[2], magic[3]
    if dtype_code not in IDX_DTYPES:
        known = ", ".join(f"0x{code:02X}" for code in IDX_DTYPES)
        raise IdxFormatError(f"{path}: unknown IDX dtype code 0x{dtype_code:02X} (known: {known})")
    if ndim == 0:
        raise IdxFormatError(f"{path}: IDX header declares 0 dimensions")
    dims = tuple(
        int(d) for d in np.frombuffer(_read_exactly(stream, 4 * ndim, path, "dimension sizes"), ">u4")
    )
    item_dtype = IDX_DTYPES[dtype_code]
    payload_bytes = math.prod(dims) * item_dtype.itemsize
    if payload_bytes > max_bytes:
        raise IdxFormatError(f"{path}: dims {dims} declare {payload_bytes} payload bytes, over the "
                             f"{max_bytes} this reader takes (or the file holds)")
    # read straight into the array returned, swapped in place: one payload-sized allocation (a ~1 MB
    # gzip may inflate to the max_bytes cap; joined blocks then a native-order copy held two at a time).
    # np.empty's pages are committed only as the stream fills them, so a header promising more than
    # the stream holds costs no memory.
    items = np.empty(math.prod(dims), dtype=item_dtype)
    _read_into(stream, memoryview(items.view(np.uint8)), path, f"payload for dims {dims}")
    if stream.read(1):
        raise IdxFormatError(
            f"{path}: oversized: data continues past the {payload_bytes} payload bytes "
            f"declared by dims {dims}"
        )
    if not item_dtype.isnative:
        items = items.byteswap(inplace=True).view(item_dtype.newbyteorder("="))
    return items.reshape(dims)


def read_idx(path: str | Path, max_bytes: int = MAX_IDX_BYTES) -> np.ndarray:
    """Read one IDX file into a native-byte-order array of the shape its header declares (at most
    ``max_bytes`` of payload; a plain file's payload at most what the file holds)."""
    path = Path(path)
    try:
        raw = open_regular(path)          # a FIFO waited for a writer for ever; /dev/zero read without end
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        raise IdxFormatError(f"{path}: not a regular file") from None
    with raw:
        is_gzip = raw.read(2) == GZIP_MAGIC
        raw.seek(0)
        if not is_gzip:
            return _parse(raw, path, min(max_bytes, os.fstat(raw.fileno()).st_size))
        try:
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                return _parse(unzipped, path, max_bytes)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise IdxFormatError(f"{path}: corrupt or truncated gzip stream: {exc}") from exc


def load_idx_dataset(images_path: str | Path, labels_path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read an image/label IDX pair: uint8 images (N, H, W) and int64 labels (N,)."""
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise IdxFormatError(
            f"{images_path}: expected uint8 images of shape (N, H, W), got {images.dtype} {images.shape}"
        )
    if 0 in images.shape[1:]:
        # refused here, not after a task's full feature extraction over images of no pixels
        raise IdxFormatError(f"{images_path}: images of shape {images.shape[1:]} hold no pixels")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise IdxFormatError(
            f"{labels_path}: expected integer labels of shape (N,), got {labels.dtype} {labels.shape}"
        )
    if len(labels) and labels.min() < 0:
        # class ids count from 0; the tasks check only the largest against the job's classes
        raise IdxFormatError(f"{labels_path}: negative label {labels.min()}: class ids count from 0")
    if len(images) != len(labels):
        raise IdxFormatError(
            f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels"
        )
    return images, labels.astype(np.int64)


def _find_idx_file(root: Path, stem: str) -> Path:
    # The Debian package ships *.gz; a hand-decompressed copy is just as good.
    for candidate in (root / f"{stem}.gz", root / stem):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem}[.gz] not found in {root}; "
        f"install it with `apt-get install dataset-fashion-mnist` or pass root= to its directory"
    )


# (images file, labels file) as they were read -> the arrays read from them, the latest KEPT_SPLITS pairs (a
# run's train and test splits); see load_fashion_mnist's ``keep``
_kept: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
_kept_lock = threading.Lock()
KEPT_SPLITS = 2


def _file_identity(path: Path) -> tuple:
    """What changes when the file does: a kept copy of another file's (or another version's) arrays is never used."""
    st = os.stat(path)
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def load_fashion_mnist(split: str = "train", root: Path | None = None,
                       keep: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST ``"train"`` (60k) or ``"test"`` (10k) split: uint8 (N, 28, 28), int64 labels 0..9.

    ``keep``: the process keeps the arrays, and a later call for the same, unchanged files returns
    copies of them instead of reading the files again. Inflating the training images costs
    ~0.25 CPU-s and a copy ~0.01; a simulation reads the split, then its report and checks read it
    again (the test suite's workers run dozens). A caller that reads the split once and holds it
    for its life (a device host) passes False: a kept copy would double its dataset's memory."""
    if split not in FASHION_MNIST_FILES:
        raise ValueError(f"unknown Fashion-MNIST split {split!r}; use one of {sorted(FASHION_MNIST_FILES)}")
    root = FASHION_MNIST_DIR if root is None else Path(root)
    files = tuple(_find_idx_file(root, stem) for stem in FASHION_MNIST_FILES[split])
    if not keep:
        return load_idx_dataset(*files)
    key = tuple(_file_identity(f) for f in files)
    with _kept_lock:
        if key not in _kept:
            arrays = load_idx_dataset(*files)
            while len(_kept) >= KEPT_SPLITS:
                del _kept[next(iter(_kept))]     # the oldest
            _kept[key] = arrays
        images, labels = _kept[key]
    return images.copy(), labels.copy()     # the caller's own writable arrays, as read_idx's are
