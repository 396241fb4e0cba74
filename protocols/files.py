"""Files both sides exchange, pin or keep secret: checksums (bundles, programs, pretrained networks),
private files (keys, credentials) and files replaced whole (a crash leaves the old or the new one);
and the lock under which threads parse arrays' headers."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import lzma
import math
import os
import tempfile
import threading
import tokenize
import zipfile
import zlib
from pathlib import Path

import numpy as np

_BLOCK = 1 << 20
# What read_npz inflates at most unless told less: the largest state a job checkpoints (Fed3R's
# dense A at p = 8,193, 0.5 GiB, and a 2^25-entry B) with room to spare.
MAX_NPZ_BYTES = 1 << 31
# a folder's fsync refused rather than failed (PostgreSQL's fsync_fname ignores the same): the rename is done
_DIR_SYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.EBADF, errno.EACCES, errno.EPERM, errno.EISDIR,
                                   errno.ENOTSUP, errno.EOPNOTSUPP})

# numpy reads every .npy header (each member of an .npz too) with ast.literal_eval, and CPython
# 3.11's AST construction is not thread-safe: two threads parsing at once can fail with
# "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905). On an emulated
# host, whose device threads load heads and state together, a good head was refused that way.
# Code that reads arrays in a thread of its own does it under this lock.
NPY_HEADER_LOCK = threading.Lock()

# what reading a damaged archive raises besides zipfile's own errors: a deflate or LZMA stream that
# does not decode raises its codec's error (zlib.error, LZMAError), which derive from no ValueError
_UNREADABLE_ARCHIVE = (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError, OSError,
                       zlib.error, lzma.LZMAError)
# what numpy's header parser raises besides ValueError: a header cut inside a bracket fails
# literal_eval, and the fallback that re-reads it as an old-style header tokenizes it (TokenError)
_UNREADABLE_HEADER = (ValueError, tokenize.TokenError)


def read_npy_header(stream) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of the .npy array ``stream`` is at, the stream left at its data;
    parsed under NPY_HEADER_LOCK, the data then read outside it."""
    with NPY_HEADER_LOCK:
        version = np.lib.format.read_magic(stream)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return read(stream)


def read_npz(data: bytes, max_bytes: int = MAX_NPZ_BYTES) -> dict[str, np.ndarray]:
    """Every array of an .npz held in memory (never a pickle): what any thread that reads a model
    or a checkpoint calls. One pass over the archive, each header parsed once under
    NPY_HEADER_LOCK; ValueError for anything else than arrays of plain dtypes.

    Nothing is inflated before the whole archive is judged: a 1.5 MiB archive of zeros is a
    1.5 GiB array, which the size of the file read (``read_job_input``'s bound) says nothing of.
    The members' sizes in the archive's directory bound what inflating can produce (zipfile stops
    at them and fails the CRC past them), and their sum must be at most ``max_bytes``; each
    member's header must declare no more data than the member holds, checked before its array is
    allocated. Each member's name ends in ``.npy`` and no two name the same array: numpy takes
    ``weight`` and ``weight.npy`` as one name and reads one of them, Java's reader another (a
    review's finding: one file, two heads)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
            _check_member_names(members)
            inflated = sum(member.file_size for member in members)
            if inflated > max_bytes:
                raise ValueError(f".npz inflates to {inflated:,} bytes, more than {max_bytes:,}")
            arrays = {}
            for member in members:
                with archive.open(member) as stream:
                    arrays[member.filename[:-len(".npy")]] = read_npy(stream, member.file_size,
                                                                     f".npz member {member.filename[:100]!r}")
            return arrays
    except _UNREADABLE_ARCHIVE as exc:
        raise ValueError(f"not a readable .npz archive: {exc}") from None


def _check_member_names(members: list[zipfile.ZipInfo]) -> None:
    seen: set[str] = set()
    for member in members:          # one pass: an archive may list very many members
        if not member.filename.endswith(".npy") or member.filename in seen:
            raise ValueError(f".npz member {member.filename[:100]!r}: every member must be one array "
                             "named *.npy, named once")
        seen.add(member.filename)


def read_npy(stream, size_bytes: int, what: str) -> np.ndarray:
    """The array of the .npy ``stream`` is at (never a pickle; ``what`` names it in a ValueError),
    its bytes read straight into a fresh array: what ``np.lib.format.read_array`` gives with
    ``allow_pickle=False``. Its header may declare no more data than ``size_bytes`` (what the
    stream holds), checked before the array is allocated."""
    try:
        shape, fortran_order, dtype = read_npy_header(stream)
    except _UNREADABLE_HEADER as exc:
        raise ValueError(f"{what} is not an .npy array: {exc}") from None
    if dtype.hasobject:
        raise ValueError(f"{what} holds Python objects, which are never loaded")
    if math.prod(shape) * dtype.itemsize > size_bytes:
        raise ValueError(f"{what}: its header declares {shape} of {dtype}, more than its {size_bytes:,} bytes")
    array = np.empty(shape[::-1] if fortran_order else shape, dtype=dtype)
    view = memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")
    filled = 0
    while filled < len(view):
        got = stream.readinto(view[filled:])
        if not got:
            raise ValueError(f"{what}: its data ends after {filled:,} of {len(view):,} bytes")
        filled += got
    return array.T if fortran_order else array


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks (bundles can be larger than memory allows)."""
    with open(path, "rb") as f:
        return stream_sha256(f)


def stream_sha256(stream) -> str:
    """The hex sha256 of what is left to read in a binary stream (a file its reader opened and
    checked), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    for block in iter(lambda: stream.read(_BLOCK), b""):
        digest.update(block)
    return digest.hexdigest()


def check_sha256(data: bytes, expected: str, what: str) -> None:
    """Refuse ``data`` (a file's bytes, read once) whose sha256 is not ``expected`` ("" accepts any):
    the bytes checked are the bytes then used, so a file swapped after the check is never loaded."""
    if expected and hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(f"{what}: sha256 does not match {expected[:16]}…")


def write_private_file(path: str | Path, data: bytes) -> None:
    """Write ``data`` (a private key, credentials) readable by its owner only, from the first byte: a
    0600 temp file beside ``path`` renamed over it (``write_atomic``), so a symbolic link planted at
    ``path`` is replaced, never followed (its target was overwritten with the secret before), and
    an existing file is replaced whole."""
    write_atomic(path, data, mode=0o600)


def check_new_file_target(path: str | Path) -> None:
    """OSError naming ``path`` unless a file can be written there now: its folder exists and takes
    a new file (a temp file made and removed), and ``path`` is not a folder. For a caller that
    must know before it makes what only it can write (an enrolment's one-time credentials)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder", str(path))
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror} (its folder {path.parent})", str(path)) from None
    os.close(fd)
    os.unlink(probe)


def write_atomic(path: str | Path, data: bytes, temp_prefix: str | None = None, *, mode: int = 0o600,
                 owner: int | None = None, durable: bool = True, replace: bool = True) -> None:
    """Replace ``path`` with ``data`` so that a crash or a power cut leaves the old file or the new
    one, never part of either: a synced temp file beside it (named ``temp_prefix``…, by default
    ``.{name}.``…), renamed over it, the folder synced. A failed write removes its temp file (on a
    full disk, a partial one would starve the retry); one a crash left is the caller's to sweep.
    ``mode`` and ``owner`` (a uid; the group is kept) are set on the temp file before the rename,
    so the file never appears with other permissions (a broker's password file, its key).
    ``durable=False``: no fsync (a cache whose reader verifies a checksum takes a file a power cut
    left zero-filled as a miss; thousands of emulated devices each writing one would pay a sync each).
    ``replace=False``: the file is linked in only where ``path`` names nothing (a name already there,
    a link planted there included, stays as it is: the caller reads and judges it), never replaced."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix or f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if owner is not None:
                os.fchown(f.fileno(), owner, -1)
            if durable:
                os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        sync_folder(path.parent)    # the rename itself survives a power cut


def sync_folder(folder: str | Path) -> None:
    """fsync ``folder``, so a name just made or renamed in it survives a power cut."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:      # a folder that cannot be opened, or a filesystem whose folders refuse
        if exc.errno not in _DIR_SYNC_UNSUPPORTED:      # fsync: the file is in place; say nothing
            raise
