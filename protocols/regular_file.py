"""Reading a file a person named (a job's input on the aggregator's host, an admin's job config or
token file), bounded before it is read.

A path can name a device (``/dev/zero`` reads without end), a FIFO (opening it for reading waits for
a writer for ever), a directory, or a file larger than its reader should hold. Only a regular file
of at most the caller's bound is read; anything else is one ``ValueError`` naming the path. The
checks run on the opened file and its bytes are read once, so a file swapped after a check is never
what is used.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_regular_file(path: str | Path, what: str, max_bytes: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes`` (``ValueError`` otherwise,
    naming it as ``what``)."""
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
