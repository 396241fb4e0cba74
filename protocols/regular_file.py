"""Reading a file a person named (a job's input on the aggregator's host, an admin's job config or
token file), bounded before it is read.

A path can name a device (``/dev/zero`` reads without end), a FIFO (opening it for reading waits for
a writer for ever), a directory, or a file larger than its reader should hold. Only a regular file
of at most the caller's bound is read; anything else is one ``ValueError`` naming the path. The
checks run on the opened file and its bytes are read once, so a file swapped after a check is never
what is used.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# An option file a person names (a list of device ids, a PEM key, a token): kilobytes, never this.
OPTION_FILE_BYTES = 16 << 20


def open_regular(path: str | Path):
    """``path`` opened for binary reading if it is a regular file (``OSError`` otherwise, EINVAL for
    another kind of file), without blocking: opening a FIFO for reading waits for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(path: str | Path, what: str, max_bytes: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes`` (``ValueError`` otherwise,
    naming it as ``what``)."""
    try:
        handle = open_regular(path)
    except OSError as exc:
        reason = "is not a regular file" if exc.errno == errno.EINVAL else f": {exc.strerror}"
        raise ValueError(f"{what} {str(path)[:200]!r}{'' if reason.startswith(':') else ' '}{reason}") from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if size > max_bytes:
            raise ValueError(f"{what} {str(path)[:200]!r} has {size} bytes, more than {max_bytes}")
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:                     # it grew after the check
        raise ValueError(f"{what} {str(path)[:200]!r} has more than {max_bytes} bytes")
    return data


def read_small_file(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes``, for a reader that says itself
    what went wrong (a device's own state files): ``FileNotFoundError`` where there is none,
    ``OSError`` for another kind of file (never blocking on a FIFO), ``ValueError`` when larger."""
    with open_regular(path) as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    return data
