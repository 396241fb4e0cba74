"""Contribution payloads as files beside the store's database: ``<db path>.blobs/<seq>.msg``.

A file is named only by its row's sequence number (an integer SQLite allocated), never by anything a
device sent, so no device or message id reaches the file system. A file is written once, never
modified: :class:`aggregator.store.Store` writes it inside the transaction that inserts its row and
makes it durable before that row commits, and deletes it only after the transaction that deleted
the row committed. So a committed row never points at a missing file; what a crash can leave is the
reverse, a file without a row, which :meth:`BlobFiles.sweep` deletes when the store opens.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable


class BlobFileError(OSError):
    """A row's payload file is missing or does not hold the number of bytes its row records."""


class BlobFiles:
    """The payload files of one store. ``durable``: fsync each file, and the directory entry that
    names it, before :meth:`write` returns (what a power cut must not undo)."""

    NAME = re.compile(r"([0-9]+)\.msg")

    def __init__(self, directory: Path, durable: bool):
        self.directory = directory
        self.durable = durable
        if not directory.is_dir():
            directory.mkdir(mode=0o700)               # device statistics: readable by the aggregator only
            if durable:
                self._fsync_dir(directory.parent)

    def path(self, seq: int) -> Path:
        return self.directory / f"{int(seq):012d}.msg"

    def write(self, seq: int, data: bytes, sync_dir: bool = True) -> None:
        """Write ``data`` as the payload of row ``seq``. The name may exist only as an orphan (a seq
        whose insert never committed is allocated again): it is truncated. A failed write leaves no file."""
        path = self.path(seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if self.durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        if sync_dir:
            self.sync_dir()

    def sync_dir(self) -> None:
        """Make the names of the files written so far durable (POSIX leaves a new file's directory
        entry to the directory's fsync, not the file's)."""
        if self.durable:
            self._fsync_dir(self.directory)

    def read(self, seq: int, nbytes: int) -> bytes:
        path = self.path(seq)
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise BlobFileError(f"payload file {path} is missing") from exc
        if len(data) != nbytes:
            raise BlobFileError(f"payload file {path} holds {len(data)} bytes, its row records {nbytes}")
        return data

    def remove(self, seqs: Iterable[int]) -> None:
        for seq in seqs:
            self.path(seq).unlink(missing_ok=True)

    def sweep(self, live: set[int]) -> tuple[int, list[int]]:
        """Delete the payload files of no row in ``live`` (a crash between a file and its row's commit,
        or between a delete's commit and the file's removal); returns (files deleted, sorted seqs of
        ``live`` that have no file). Other names in the directory are left alone."""
        removed, present = 0, set()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                match = self.NAME.fullmatch(entry.name)
                if match is None or self.path(int(match[1])).name != entry.name:
                    continue
                seq = int(match[1])
                if seq in live:
                    present.add(seq)
                else:
                    os.unlink(entry.path)
                    removed += 1
        return removed, sorted(live - present)

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
