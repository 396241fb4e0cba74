"""The files a job's config names on the aggregator's host (a Fed3R model.npz to start from, a
tail program, a pretrained network, SecAgg key files), checked before they are read.

A config is an operator's input, sent through the admin API: a path that names a device
(``/dev/zero``), a FIFO or a directory would make the service thread that builds the job read
forever, block, or fail obscurely, and a huge file would fill its memory. Only a regular file of
bounded size is read; anything else is one clear error, and the job does not start. The checks
run on the opened file and its bytes are read once (:func:`read_job_input`): whoever hashes them
loads those same bytes, so a file swapped after a check is never what is used.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_JOB_FILE_BYTES = 1 << 30        # a pretrained segmentation network or tail program is ~10-100 MB


def read_job_input(path: str | Path, what: str, max_bytes: int = MAX_JOB_FILE_BYTES) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes`` (ValueError otherwise)."""
    try:      # non-blocking: opening a FIFO for reading would wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"{what} {str(path)[:200]!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what} {str(path)[:200]!r} is not a regular file")
        if info.st_size > max_bytes:
            raise ValueError(f"{what} {str(path)[:200]!r} has {info.st_size} bytes, more than {max_bytes}")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:                     # it grew after the check
        raise ValueError(f"{what} {str(path)[:200]!r} has more than {max_bytes} bytes")
    return data
