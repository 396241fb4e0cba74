"""Describe artifacts (sha256, size) and write a bundle directory all-or-nothing.

The manifest format is defined by :mod:`protocols.bundle_manifest` (what devices read);
this module only fills it in. A bundle is written into a hidden staging directory next to
the destination and renamed into place when complete, so a failed or interrupted export
never leaves a partial bundle under the destination name.
"""

from __future__ import annotations

import hashlib
import os
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
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True (--overwrite) to replace it")
        if not _holds_earlier_export(out_dir):
            raise FileExistsError(f"{out_dir} is not empty and holds no bundle (a {MANIFEST_FILENAME} that "
                                  f"fedfleet export wrote): --overwrite replaces an earlier export only")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        os.chmod(staging, 0o755)  # mkdtemp makes it owner-only; a device agent may run as another user
        for name, data in files.items():
            _write_synced(staging / name, data)
        _write_synced(staging / MANIFEST_FILENAME, manifest.dumps().encode("utf-8"))
        if out_dir.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
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
    return out_dir / MANIFEST_FILENAME


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
