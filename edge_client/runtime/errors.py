"""Errors raised by the runtime layer, shared by every runtime backend."""

from __future__ import annotations

from protocols.bundle_manifest import ArtifactError, ManifestError

__all__ = [
    "ArtifactError",
    "ArtifactMissingError",
    "ArtifactTamperedError",
    "ManifestError",
    "RuntimeUnavailableError",
]


class ArtifactMissingError(ArtifactError, FileNotFoundError):
    """A file the manifest lists is not in the bundle directory."""


class ArtifactTamperedError(ArtifactError):
    """A file's sha256 differs from the manifest's (or the manifest's from the expected one)."""


class RuntimeUnavailableError(ArtifactError, ImportError):
    """None of the requested runtimes is both installed and present in the bundle.

    The message names the runtimes the bundle offers and the pip packages that provide them.
    """
