"""Describe artifacts (sha256, size) and write a bundle directory all-or-nothing.

The manifest format is defined by :mod:`protocols.bundle_manifest` (what devices read);
this module only fills it in. A bundle is written into a hidden staging directory next to
the destination and renamed into place when complete, so a failed or interrupted export
never leaves a partial bundle under the destination name.

A writer holds an exclusive ``flock`` on ``.<name>.write-lock`` beside the destination from before
it stages until its folders are gone, so whatever staging (``.<name>.partial-*``) or retired bundle
(``.<name>.old-*``) the next writer finds there belongs to a writer that died (SIGKILL, power cut):
it deletes them, first putting a retired bundle back when its writer was killed between the two
renames of a replacement (the destination missing, that writer's staging still there). It mends
the other destinations' leftovers in that folder too, those whose lock file a killed writer left and
no live writer holds (tried without waiting). A lock rather than the writer's pid in the folder name:
the kernel drops it when its holder dies, whatever pid reuse, pid namespaces (containers) or other
hosts sharing the folder would make of a pid. It is not ``fedfleet.bundles``' ``.<name>.lock``,
which that module holds around a whole export ending in this write (a second flock on that file
from the same process would wait for itself).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from protocols.bundle_manifest import (
    FORMAT_NAME,
    MANIFEST_FILENAME,
    ArtifactSpec,
    BatchSpec,
    Manifest,
    ManifestError,
    TensorSpec,
    read_manifest_bytes,
)
from protocols.envelope import parse_strict_json

__all__ = ["describe_artifact", "write_bundle"]

log = logging.getLogger(__name__)

STAGING_INFIX, RETIRED_INFIX, LOCK_SUFFIX = ".partial-", ".old-", ".write-lock"


def describe_artifact(kind: str, runtime: str, runtime_version: str, file: str, data: bytes,
                      batch: BatchSpec, inputs: tuple[TensorSpec, ...],
                      outputs: tuple[TensorSpec, ...], details: Mapping[str, Any],
                      parity: Mapping[str, Any] | None = None) -> ArtifactSpec:
    """The manifest entry for ``data`` (to be written as ``file``)."""
    return ArtifactSpec(
        kind=kind, runtime=runtime, runtime_version=runtime_version, file=file,
        sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), batch=batch,
        inputs=inputs, outputs=outputs, parity=dict(parity or {}), details=dict(details))


def write_bundle(out_dir: str | Path, manifest: Manifest, files: Mapping[str, bytes],
                 overwrite: bool = False) -> Path:
    """Write ``files`` and the manifest to ``out_dir``; returns the manifest's path.

    Refuses to touch an existing non-empty ``out_dir`` unless ``overwrite``, and even then one that
    holds no earlier export (:func:`_holds_earlier_export`): ``--overwrite`` replaces an earlier
    export, never a folder of the user's (a review found ``--out ~/thesis --overwrite`` deleted the
    thesis).
    """
    out_dir = Path(out_dir)
    listed = {spec.file for spec in manifest.artifacts}
    if listed != set(files):
        raise ValueError(f"files {sorted(files)} differ from the manifest's {sorted(listed)}")
    for spec in manifest.artifacts:
        if hashlib.sha256(files[spec.file]).hexdigest() != spec.sha256:
            raise ValueError(f"{spec.file}: bytes do not match the manifest's sha256")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _WriterLock(out_dir):
        _recover_from_dead_writers(out_dir)
        _recover_dead_writers_beside(out_dir)
        _check_replaceable(out_dir, overwrite)
        _replace_with_staged(out_dir, manifest, files)
    return out_dir / MANIFEST_FILENAME


def _check_replaceable(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True (--overwrite) to replace it")
        if not _holds_earlier_export(out_dir):
            raise FileExistsError(f"{out_dir} is not empty and holds no bundle (a {MANIFEST_FILENAME} that "
                                  f"fedfleet export wrote): --overwrite replaces an earlier export only")


def _replace_with_staged(out_dir: Path, manifest: Manifest, files: Mapping[str, bytes]) -> None:
    staging = Path(tempfile.mkdtemp(prefix=_leftover_name(out_dir, STAGING_INFIX, ""), dir=out_dir.parent))
    try:
        os.chmod(staging, 0o755)  # mkdtemp makes it owner-only; a device agent may run as another user
        for name, data in files.items():
            _write_synced(staging / name, data)
        _write_synced(staging / MANIFEST_FILENAME, manifest.dumps().encode("utf-8"))
        if out_dir.exists():
            # named after the staging folder: the next writer tells a kill between the two renames (both
            # folders there) from one after them (the staging renamed away)
            token = _leftover_token(out_dir, STAGING_INFIX, staging)
            retired = out_dir.parent / _leftover_name(out_dir, RETIRED_INFIX, token)
            retired.mkdir(mode=0o700)
            try:
                os.replace(out_dir, retired / "bundle")
                os.replace(staging, out_dir)
            finally:
                if (retired / "bundle").exists() and not out_dir.exists():
                    os.replace(retired / "bundle", out_dir)           # the old bundle back where it was
                shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


class _WriterLock:
    """The exclusive lock on ``.<name>.write-lock`` beside ``out_dir``, waited for (see the module
    docstring); a second writer of the same destination waits for the first to finish.

    The holder deletes the lock file before it lets go, so none stays beside a bundle; a waiter that
    then gets the lock of a deleted file (or of one replaced since) sees that the name no longer
    leads to it and locks the file now there instead."""

    def __init__(self, out_dir: Path):
        self.path = out_dir.parent / f".{out_dir.name}{LOCK_SUFFIX}"

    def __enter__(self) -> None:
        self.acquire(wait=True)

    def __exit__(self, *exc_info) -> None:
        self.release()

    def acquire(self, wait: bool) -> bool:
        """Lock, waiting for a live holder when ``wait``; else False at once when one holds it, or when
        no lock file is there (no writer, live or dead, left one: there is nothing to mend)."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if wait else 0)
        while True:
            # O_NOFOLLOW: a link planted under the lock's name is refused, not followed to its target
            try:
                fd = os.open(self.path, flags, 0o644)
            except FileNotFoundError:
                return False                # only without O_CREAT
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked, named = os.fstat(fd), os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                os.close(fd)                # deleted by the writer before us: lock the next one
                continue
            except BlockingIOError:
                os.close(fd)                # a live writer holds it
                return False
            except BaseException:
                os.close(fd)
                raise
            if (locked.st_dev, locked.st_ino) == (named.st_dev, named.st_ino):
                self.fd = fd
                return True
            os.close(fd)

    def release(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass                            # left for the next writer, which locks it as it finds it
        os.close(self.fd)                   # closing the only descriptor releases the lock


def _leftover_name(out_dir: Path, infix: str, token: str) -> str:
    """A writer's hidden folder beside ``out_dir``: ``.<name><infix><token>``."""
    return f".{out_dir.name}{infix}{token}"


def _leftover_token(out_dir: Path, infix: str, folder: Path) -> str:
    return folder.name[len(_leftover_name(out_dir, infix, "")):]


def _recover_from_dead_writers(out_dir: Path) -> None:
    """Delete the staging and retired folders of ``out_dir``'s dead writers, first putting back the
    bundle one of them had retired when it was killed between its two renames: ``out_dir`` missing,
    the writer's staging folder still there. Called with the writer lock held, so no live writer owns
    any of them."""
    leftovers = {STAGING_INFIX: [], RETIRED_INFIX: []}
    for infix, found in leftovers.items():
        # exactly mkdtemp's names (random part without dots): another destination's staging, such as
        # ``.bundle.partial-x.partial-abc`` of a destination "bundle.partial-x", never matches "bundle"'s
        pattern = re.compile(re.escape(_leftover_name(out_dir, infix, "")) + r"[^.]+")
        with os.scandir(out_dir.parent) as entries:
            found += [Path(entry.path) for entry in entries
                      if pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)]
    for folder in leftovers[RETIRED_INFIX]:
        bundle = folder / "bundle"
        staged = out_dir.parent / _leftover_name(out_dir, STAGING_INFIX, _leftover_token(out_dir, RETIRED_INFIX, folder))
        if (not os.path.lexists(out_dir) and staged in leftovers[STAGING_INFIX] and bundle.is_dir()
                and not bundle.is_symlink()):
            os.replace(bundle, out_dir)
            log.warning("%s was missing, its previous bundle left in %s by an export that died while "
                        "replacing it: put back", out_dir, folder)
    for folder in leftovers[STAGING_INFIX] + leftovers[RETIRED_INFIX]:
        try:
            shutil.rmtree(folder)
        except OSError as error:    # what is left is a dead writer's: no reason to refuse this export
            log.warning("could not delete %s, left by an export that died: %s", folder, error)


def _recover_dead_writers_beside(out_dir: Path) -> None:
    """Mend the leftovers of dead writers of other destinations in ``out_dir``'s folder: a name never
    written again (fedfleet.bundles names its folders after the exporter's revision and the weights'
    digest) kept a killed export's staging for good. Only a destination whose writer lock file is there
    is looked at (a killed writer never deleted its own; a folder merely named like a leftover is not
    the exporter's), and only when its lock is free at once: a live writer's is never waited for nor
    touched. Taking a second lock without waiting cannot deadlock with a writer that holds it and tries
    ours. A failure here is logged: it is no reason to refuse this export."""
    with os.scandir(out_dir.parent) as entries:
        locks = [entry.name for entry in entries if entry.name.startswith(".")
                 and entry.name.endswith(LOCK_SUFFIX) and entry.is_file(follow_symlinks=False)]
    for name in (lock_name[1:-len(LOCK_SUFFIX)] for lock_name in locks):
        if name in ("", ".", "..", out_dir.name):       # the first three name no sibling folder
            continue
        other = out_dir.parent / name
        lock = _WriterLock(other)
        try:
            if not lock.acquire(wait=False):
                continue
            try:
                _recover_from_dead_writers(other)
            finally:
                lock.release()
        except OSError as error:
            log.warning("could not mend what a dead export of %s left: %s", other, error)


def _holds_earlier_export(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds what this module writes: a manifest.json (a regular file, not a link)
    whose ``format`` is ours. Any file of that name was taken for one, and ``manifest.json`` is a common
    name (browser extensions, web apps, other tools' folders): a review found ``--overwrite`` deleted
    such a folder whole. Not a full validation, so a bundle of an older format version is still
    replaced."""
    path = out_dir / MANIFEST_FILENAME
    if path.is_symlink():       # write_bundle never writes one: a link names someone else's bundle
        return False
    try:
        _, raw = read_manifest_bytes(path)
        data = parse_strict_json(raw)
    except (ManifestError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT_NAME


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
