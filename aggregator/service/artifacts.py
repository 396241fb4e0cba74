"""The aggregator's shelf of device artifacts (exported bundles), served by sha256.

Bundles are directories written by ``fedfleet export`` (a ``manifest.json`` plus the files it
lists). The shelf indexes the manifest and every file by their sha256 when a bundle is added;
devices then fetch them over the broker (``protocols.payloads.artifacts``). Files are read at
serve time, not cached, so a bundle can be large; the device verifies every digest itself.
"""

from __future__ import annotations

from pathlib import Path

from protocols.bundle_manifest import MANIFEST_FILENAME, read_manifest
from protocols.files import file_sha256

MAX_ARTIFACT_BYTES = 256 * 1024 * 1024


class ArtifactShelf:
    def __init__(self, bundles: list[Path] = ()):
        self._files: dict[str, Path] = {}
        for b in bundles:
            self.add_bundle(b)

    def add_bundle(self, bundle_dir: Path) -> str:
        """Index a bundle; returns its manifest's sha256 (what a job announces to devices)."""
        bundle_dir = Path(bundle_dir)
        manifest = bundle_dir / MANIFEST_FILENAME
        for spec in read_manifest(manifest).artifacts:       # the format devices read, validated
            path = bundle_dir / spec.file
            if path.resolve().parent != bundle_dir.resolve():
                raise ValueError(f"manifest lists a file outside its bundle: {spec.file!r}")
            if path.stat().st_size > MAX_ARTIFACT_BYTES:
                raise ValueError(f"{path} is larger than {MAX_ARTIFACT_BYTES} bytes")
            if file_sha256(path) != spec.sha256:
                raise ValueError(f"{path}: sha256 differs from the manifest's (tampered or stale bundle)")
            self._files[spec.sha256] = path
        digest = file_sha256(manifest)
        self._files[digest] = manifest
        return digest

    def get(self, sha256: str) -> tuple[str, bytes] | None:
        path = self._files.get(sha256)
        return None if path is None else (path.name, path.read_bytes())

    def __contains__(self, sha256: str) -> bool:
        return sha256 in self._files
