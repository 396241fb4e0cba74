"""Reading a file a person named (a job's input on the aggregator's host, an admin's job config or
token file), bounded before it is read.

A path can name a device (``/dev/zero`` reads without end), a FIFO (opening it for reading waits for
a writer for ever), a directory, or a file larger than its reader should hold. Only a regular file
of at most the caller's bound is read; anything else is one ``ValueError`` naming the path. The
checks run on the opened file and its bytes are read once, so a file swapped after a check is never
what is used.

A file a program keeps for itself (the aggregator's payload files and round logs) is opened the
same way, for reading or writing, and without following a symbolic link planted under its name
(:func:`open_regular_fd` with ``follow_links=False``): a link there would have it read or write
whatever file it points at.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# An option file a person names (a list of device ids, a PEM key, a token): kilobytes, never this.
OPTION_FILE_BYTES = 16 << 20


def open_regular_fd(path: str | Path, flags: int = os.O_RDONLY, *, follow_links: bool = True,
                    mode: int = 0o600) -> int:
    """A descriptor of ``path`` opened with ``flags`` (``O_CREAT`` makes it with ``mode``) if it is a
    regular file, without blocking: opening a FIFO waits for its other end (for writing without
    one: ENXIO). ``OSError`` otherwise: EINVAL for another kind of file (a FIFO, a device, a
    folder opened for reading; EISDIR for writing), ELOOP for a symbolic link unless
    ``follow_links`` (a file a program keeps for itself, whose name someone could replace by a link
    to anything it may write or read)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW), mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def not_regular(exc: OSError) -> str | None:
    """What an :func:`open_regular_fd` refusal says of the name, or None for another error (no such
    name, no permission, a full disk): words to follow the path in a message."""
    if exc.errno == errno.ELOOP:
        return "is not a regular file (a symbolic link)"
    if exc.errno in (errno.EINVAL, errno.EISDIR, errno.ENXIO):      # another kind; a folder or FIFO opened to write
        return "is not a regular file"
    return None


def open_regular(path: str | Path, *, follow_links: bool = True):
    """``path`` opened for binary reading if it is a regular file (``OSError`` otherwise: see
    :func:`open_regular_fd`), without blocking: opening a FIFO for reading waits for a writer."""
    fd = open_regular_fd(path, follow_links=follow_links)
    try:
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
