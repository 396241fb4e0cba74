"""A folder a device fills with what it fetched or computed, kept within a byte budget.

A device keeps, for the jobs it served, each bundle a job named (``--bundle-dir``: one folder per
bundle, tens of MB) and each feature matrix it extracted (``--cache-dir``: n × d float32 per
model and image set). Every model the fleet rolls out adds one of each, so a device left running
for a year filled its disk. :class:`DiskBudget` removes the least recently used entries until the
folder is within its budget again.

"Used" is an entry's mtime: the feature cache touches a file on every hit and the bundle fetcher
touches a bundle's folder whenever a job asks for it, so the oldest mtime is the entry nobody
asked for longest. An entry in ``keep`` (in use: a bundle whose program is loaded, the file just
written) is never removed: the budget can be exceeded by those alone, never by anything else.
Removing an entry costs the device a recompute or a re-fetch when it is asked for again, never a
wrong answer: a cache file that vanishes mid-read is recomputed (``FeatureExtractor``), a bundle
is verified file by file when it is fetched again.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("fedfleet.device")


@dataclass(frozen=True)
class DiskBudget:
    root: Path
    max_bytes: int
    pattern: str = "*"       # the entries it manages (a glob in ``root``); anything else is left alone

    def __post_init__(self):
        if self.max_bytes <= 0:
            raise ValueError(f"a disk budget must be positive, got {self.max_bytes} bytes")

    def trim(self, keep=()) -> list[Path]:
        """Remove the least recently used entries beyond the budget (not those in ``keep``); what it removed."""
        keep = {Path(k) for k in keep}
        entries = []
        for path in self.root.glob(self.pattern):
            try:
                entries.append((path.lstat().st_mtime, _size(path), path))
            except OSError:                 # removed meanwhile by another process, or unreadable: not counted
                continue
        total = sum(size for _, size, _ in entries)
        removed = []
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            if path in keep:
                continue
            try:
                remove_entry(path)
            except OSError as exc:          # a device goes on with a fuller disk, never stops for it
                log.warning("%s: cannot remove %s: %s", self.root, path.name, exc)
                total -= size - _size_left(path)      # what did go counts as freed
                continue
            total -= size
            removed.append(path)
        if removed:
            log.info("%s: removed %d least recently used entries to stay within %d bytes", self.root, len(removed),
                     self.max_bytes)
        return removed


def touch(path: Path) -> None:
    """Mark ``path`` as used now (a no-op when it is gone)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _size_left(path: Path) -> int:
    """What an entry still holds (0 once it is gone, even if it goes while it is measured)."""
    try:
        return _size(path)
    except OSError:
        return 0


def remove_entry(path: Path) -> None:
    """Remove an entry whole, or raise OSError: a folder rmtree left part of (a file it could not
    remove) still holds bytes, and counted as removed it let the folder stay over its budget."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)     # whatever it can: a half-removed bundle is refetched whole
        if path.exists():
            raise OSError(f"{path.name} could not be removed whole")
    else:
        path.unlink(missing_ok=True)
