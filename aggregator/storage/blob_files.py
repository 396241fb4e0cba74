"""Contribution payloads as files beside the store's database: ``<db path>.blobs/<seq>.msg``.

A file is named only by its row's sequence number (an integer SQLite allocated), never by anything a
device sent, so no device or message id reaches the file system. :class:`aggregator.storage.store.Store`
writes a payload inside the transaction that inserts its row and makes it durable before that row
commits, and deletes it only after the transaction that deleted the row committed. So a committed
row never points at a missing file; what a crash can leave is the reverse, bytes of no row, which
:meth:`BlobFiles.sweep` removes when the store opens.

Durable names in batches: POSIX makes a new file's name durable with an fsync of its directory, not
of the file (ext4, XFS and btrfs happen to do both with the file's fsync; other file systems need
not), and that directory fsync cost about as much again as the SQLite commit of the row. So names
are created ahead, :attr:`BlobFiles.SPARES` empty files at a time with one directory fsync; a payload
is then written into its already durable name and only the file is fsynced. An empty file whose seq
is above the table's AUTOINCREMENT mark is such a spare; SQLite gives each of those seqs out later.

Durable payloads bypass the page cache (``O_DIRECT``, through an aligned bounce buffer): on the
development VM a buffered 6.6 MB write cost ~14 ms of kernel CPU and ~17 ms until its fsync
returned, a direct one ~0.5 ms of CPU and ~3 ms (``bench/store_write.py`` compares them). The CPU
matters most: an aggregator ingesting large results shares its cores with the broker and the
validation. A file system that refuses ``O_DIRECT`` gets buffered writes, as do small payloads.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import threading
from pathlib import Path
from typing import Iterable

from protocols.regular_file import not_regular, open_regular_fd

log = logging.getLogger("fedfleet.aggregator")

# never through a link, never waiting on a FIFO (without a reader: ENXIO) under a payload's name
_WRITE = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_ALIGN = 4096                   # O_DIRECT offsets and lengths: a multiple of the device's block size


class BlobFileError(OSError):
    """A row's payload file is missing or does not hold the number of bytes its row records."""


class BlobNameTaken(BlobFileError):
    """A new payload's name holds what no store made there (a folder holding files, which the sweep
    leaves alone; a link, a hard link or a FIFO put there since the store opened): nothing was written."""


class BlobFiles:
    """The payload files of one store. ``durable``: a payload's bytes and its name are on disk (fsync)
    before :meth:`write` returns (what a power cut must not undo)."""

    NAME = re.compile(r"([0-9]+)\.msg")
    SPARES = 64                      # names made durable per directory fsync
    DIRECT_FROM = 256 * 1024         # payloads at least this large are written around the page cache
    BOUNCE = 4 << 20                 # bytes copied into the aligned buffer per direct write()

    def __init__(self, directory: Path, durable: bool):
        self.directory = directory
        self.durable = durable
        self.direct = durable and hasattr(os, "O_DIRECT")     # off for good once the file system refuses it
        self._bounce = threading.local()              # one aligned buffer per thread that writes
        if not directory.is_dir():
            directory.mkdir(mode=0o700)               # device statistics: readable by the aggregator only
            if durable:
                self._fsync_dir(directory.parent)

    def path(self, seq: int) -> Path:
        return self.directory / f"{int(seq):012d}.msg"

    def write(self, seq: int, data: bytes) -> None:
        """Write ``data`` as the payload of row ``seq``, into its name made durable beforehand. The name
        may hold bytes of no row (a seq whose insert never committed is given again): they are replaced.
        A failed write leaves the file empty. :class:`BlobNameTaken` where the name is no regular
        file of its own (a link, a FIFO, a folder, a hard link: never written through, never waited on)."""
        path = self.path(seq)
        try:
            try:
                fd = open_regular_fd(path, _WRITE, follow_links=False)
            except FileNotFoundError:
                self._create_names(seq)
                fd = open_regular_fd(path, _WRITE, follow_links=False)
        except OSError as exc:
            if (why := not_regular(exc)) is None:
                raise
            raise BlobNameTaken(f"payload name {path} {why}: no file of this store's (remove it)") from None
        # truncated only once it is known to be the store's own: a hard link put under a spare name
        # shares its file with another name, and O_TRUNC at open emptied that other file (a review's
        # finding, as the links and FIFOs above)
        if os.fstat(fd).st_nlink != 1:
            os.close(fd)
            raise BlobNameTaken(f"payload name {path} is not a regular file of its own (a hard link): "
                                "no file of this store's (remove it)")
        try:
            os.ftruncate(fd, 0)
            if not (self.direct and len(data) >= self.DIRECT_FROM and self._write_direct(fd, data)):
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            if self.durable:
                os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, 0)
            raise
        finally:
            os.close(fd)

    def _write_direct(self, fd: int, data: bytes) -> bool:
        """Write ``data`` into the empty file ``fd`` with O_DIRECT, in aligned blocks copied through
        this thread's bounce buffer (the last one padded, then cut back to ``len(data)``). False,
        the file empty again, if the file system refuses O_DIRECT: the caller writes it buffered."""
        import fcntl               # here: POSIX only, and only where os.O_DIRECT exists (Linux)

        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
            buffer = getattr(self._bounce, "buffer", None)
            if buffer is None:
                buffer = self._bounce.buffer = mmap.mmap(-1, self.BOUNCE)     # page-aligned
            view = memoryview(data)
            for start in range(0, len(data), self.BOUNCE):
                block = view[start:start + self.BOUNCE]
                buffer[:len(block)] = block
                padded = -(-len(block) // _ALIGN) * _ALIGN
                if len(block) < padded:
                    buffer[len(block):padded] = bytes(padded - len(block))
                with memoryview(buffer)[:padded] as out:
                    if os.write(fd, out) != padded:
                        raise OSError(errno.EIO, "short O_DIRECT write")
            os.ftruncate(fd, len(data))
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct = False
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            return False
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return True

    def _create_names(self, seq: int) -> None:
        """Empty files for ``seq`` and the next seqs, their names durable with one directory fsync."""
        os.close(os.open(self.path(seq), _WRITE | os.O_CREAT, 0o600))
        for spare in range(seq + 1, seq + self.SPARES):
            try:
                os.close(os.open(self.path(spare), _WRITE | os.O_CREAT, 0o600))
            except OSError:         # a folder or link of someone else's under that name: its own write will say
                pass
        if self.durable:
            self._fsync_dir(self.directory)

    def read(self, seq: int, nbytes: int) -> bytes:
        """The ``nbytes`` of row ``seq``'s file. Its name is opened without following a link and
        without waiting (a FIFO there blocked the reader for ever, a link to /dev/zero was read until
        memory ran out), and its size checked before a byte is read."""
        path = self.path(seq)
        try:
            fd = open_regular_fd(path, follow_links=False)
        except FileNotFoundError as exc:
            raise BlobFileError(f"payload file {path} is missing") from exc
        except OSError as exc:
            raise BlobFileError(f"payload file {path} {not_regular(exc) or f'cannot be opened ({exc.strerror})'}") \
                from None
        try:
            st = os.fstat(fd)
            if st.st_size != nbytes:
                raise BlobFileError(f"payload file {path} holds {st.st_size} bytes, its row records {nbytes}")
            chunks, got = [], 0
            while got < nbytes and (chunk := os.pread(fd, nbytes - got, got)):    # one call but past 2 GiB
                chunks.append(chunk)
                got += len(chunk)
            data = b"".join(chunks)
        finally:
            os.close(fd)
        if len(data) != nbytes:             # shortened since its fstat
            raise BlobFileError(f"payload file {path} holds {len(data)} bytes, its row records {nbytes}")
        return data

    def remove(self, seqs: Iterable[int]) -> None:
        """Delete the files of rows whose delete has committed: cleanup, never a failure of that
        committed operation (a folder under such a name raised after a ``device forget`` committed,
        which then reported failure). A name that cannot go is logged; the others still go."""
        for seq in seqs:
            path = self.path(seq)
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("payload file %s of a deleted contribution not removed: %s", path, exc.strerror or exc)

    def sweep(self, live: set[int], high: int) -> tuple[int, list[int]]:
        """Remove the bytes of no row in ``live`` (a crash between a file and its row's commit, or between
        a delete's commit and the file's removal): a file of a seq up to ``high`` (the AUTOINCREMENT mark:
        never given again) is deleted, one above it is emptied (a spare again). Returns (files that held
        such bytes, sorted seqs of ``live`` with no file). A link, a hard link or another node (a FIFO)
        under a payload name of no row is removed itself, never followed nor emptied; an empty folder there too; one
        holding files, and other names in the directory, are left alone. A live row's name that is no
        regular file counts as missing (:meth:`read` refuses it)."""
        dropped, present = 0, set()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                match = self.NAME.fullmatch(entry.name)
                if match is None or self.path(int(match[1])).name != entry.name:
                    continue
                seq = int(match[1])
                regular = entry.is_file(follow_symlinks=False)
                if seq in live:
                    if regular:             # a link, FIFO or folder is no payload: said missing
                        present.add(seq)
                    continue
                if entry.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):      # an empty one only: a folder's files are not ours
                        os.rmdir(entry.path)
                    continue
                # a link or node goes itself, never what it points at (truncating through a link
                # emptied its target: an operator's file, the DB); so does a hard link, whose file
                # another name shares
                info = entry.stat(follow_symlinks=False)
                size = info.st_size if regular else 1
                dropped += size > 0
                if seq <= high or not regular or info.st_nlink != 1:
                    os.unlink(entry.path)
                elif size:
                    os.truncate(entry.path, 0)
        if self.durable:
            self._fsync_dir(self.directory)           # names a crashed process created before its fsync
        return dropped, sorted(live - present)

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
