"""Integrity checks: a device runs only files whose sha256 matches the manifest.

The bytes that are hashed are the bytes handed to the runtime (``read_verified``), so a file
swapped between the check and the load cannot slip through. The manifest itself is trusted
only as far as its own digest is: pass the digest the server announced (over the signed
protocol channel) as ``expected_manifest_sha256`` to pin it too.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from protocols.files import file_sha256

from edge_client.runtime.errors import (
    ArtifactMissingError,
    ArtifactTamperedError,
    ManifestError,
)
from protocols.bundle_manifest import (
    MANIFEST_FILENAME,
    ArtifactSpec,
    Manifest,
    read_manifest,
)

__all__ = ["file_sha256", "read_verified", "load_manifest", "verify_bundle"]


def _same_digest(actual: str, expected: str) -> bool:
    return hmac.compare_digest(actual.encode("ascii"), expected.lower().encode("ascii"))


def load_manifest(manifest_path: str | Path,
                  expected_manifest_sha256: str | None = None) -> Manifest:
    """Read and validate a manifest, first checking its own digest when one is expected."""
    path = Path(manifest_path)
    if path.is_dir():
        path = path / MANIFEST_FILENAME
    if expected_manifest_sha256 is not None:
        if not path.is_file():
            raise ManifestError(f"no manifest at {path}")
        actual = file_sha256(path)
        if not _same_digest(actual, expected_manifest_sha256):
            raise ArtifactTamperedError(
                f"{path} has sha256 {actual}, expected {expected_manifest_sha256}; "
                "refusing the bundle (the manifest was altered or is not the announced one)")
    return read_manifest(path)


def read_verified(manifest: Manifest, spec: ArtifactSpec) -> bytes:
    """The contents of ``spec.file``, after checking its size and sha256 against the manifest."""
    path = manifest.directory / spec.file
    try:
        with open(path, "rb") as handle:
            # One byte more than promised is enough to tell the file has grown.
            data = handle.read(spec.size_bytes + 1)
    except FileNotFoundError:
        raise ArtifactMissingError(
            f"{path} is listed in the manifest but missing from the bundle") from None
    actual = hashlib.sha256(data).hexdigest()
    if len(data) != spec.size_bytes or not _same_digest(actual, spec.sha256):
        size_note = "" if len(data) == spec.size_bytes else (
            f" (size differs: manifest says {spec.size_bytes} bytes)")
        raise ArtifactTamperedError(
            f"refusing {path}: its sha256 does not match the manifest{size_note}; "
            f"expected {spec.sha256}, got {actual if len(data) == spec.size_bytes else 'n/a'}. "
            "Re-download the bundle from the server.")
    return data


def verify_bundle(manifest_path: str | Path,
                  expected_manifest_sha256: str | None = None) -> Manifest:
    """Check every file of a bundle (e.g. right after download); returns the manifest."""
    manifest = load_manifest(manifest_path, expected_manifest_sha256)
    for spec in manifest.artifacts:
        read_verified(manifest, spec)
    return manifest
