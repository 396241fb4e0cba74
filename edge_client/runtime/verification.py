"""Integrity checks: a device runs only files whose sha256 matches the manifest.

The bytes that are hashed are the bytes handed to the runtime (``read_verified``), so a file
swapped between the check and the load cannot slip through. The manifest itself is trusted
only as far as its own digest is: pass the digest the server announced (over the signed
protocol channel) as ``expected_manifest_sha256`` to pin it too.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from protocols.files import file_sha256
from protocols.regular_file import open_regular

from edge_client.runtime.errors import (
    ArtifactMissingError,
    ArtifactTamperedError,
)
from protocols.bundle_manifest import (
    ArtifactSpec,
    Manifest,
    parse_manifest,
    read_manifest_bytes,
)

__all__ = ["file_sha256", "read_verified", "load_manifest", "verify_bundle"]

# The most bytes of one artifact a device reads (an EfficientNet-Lite0 .pte is ~20 MB): a manifest
# claiming 6 GiB beside a sparse file of that size made the read a MemoryError (a review's finding).
MAX_ARTIFACT_BYTES = 1 << 30


def _same_digest(actual: str, expected: str) -> bool:
    return hmac.compare_digest(actual.encode("ascii"), expected.lower().encode("ascii"))


def load_manifest(manifest_path: str | Path,
                  expected_manifest_sha256: str | None = None) -> Manifest:
    """Read and validate a manifest, first checking its own digest when one is expected (on the
    bytes that are then parsed: the file is read once)."""
    path, raw = read_manifest_bytes(manifest_path)
    if expected_manifest_sha256 is not None:
        actual = hashlib.sha256(raw).hexdigest()
        if not _same_digest(actual, expected_manifest_sha256):
            raise ArtifactTamperedError(
                f"{path} has sha256 {actual}, expected {expected_manifest_sha256}; "
                "refusing the bundle (the manifest was altered or is not the announced one)")
    return parse_manifest(raw, path)


def read_verified(manifest: Manifest, spec: ArtifactSpec) -> bytes:
    """The contents of ``spec.file``, after checking its size and sha256 against the manifest. The
    file's size is checked before anything is read (a manifest may claim any size), and only a
    regular file is read (a FIFO would block the device)."""
    path = manifest.directory / spec.file
    if spec.size_bytes > MAX_ARTIFACT_BYTES:        # a manifest may claim any size: never read past this
        raise ArtifactTamperedError(f"refusing {path}: the manifest says {spec.size_bytes} bytes, more than a "
                                    f"device reads ({MAX_ARTIFACT_BYTES})")
    try:
        # opened without blocking, a regular file only: a FIFO in its place blocked the device
        with open_regular(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size != spec.size_bytes:
                raise ArtifactTamperedError(f"refusing {path}: its size differs from the manifest's ({size} bytes "
                                            f"where it says {spec.size_bytes} bytes). Re-download the bundle from the server.")
            # One byte more than promised is enough to tell the file has grown since.
            data = handle.read(spec.size_bytes + 1)
    except FileNotFoundError:
        raise ArtifactMissingError(
            f"{path} is listed in the manifest but missing from the bundle") from None
    except OSError as exc:
        raise ArtifactTamperedError(f"refusing {path}: {exc.strerror} (a regular file of "
                                    f"{spec.size_bytes} bytes expected)") from None
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
