"""The aggregator's shelf of device artifacts (exported bundles), served by sha256.

Bundles are directories written by ``fedfleet export`` (a ``manifest.json`` plus the files it
lists). The shelf indexes the manifest and every file by their sha256 when a bundle is added;
devices then fetch them over the broker (``protocols.payloads.artifacts``). Files are read at
serve time, not cached, so a bundle can be large. What is read is sent only if it is the file
indexed: a regular file of the indexed size hashing to the indexed sha256 (a review's finding: a
file swapped after indexing for a link outside the folder was sent, bytes and all, to any device
asking; one swapped for a FIFO held the service loop for ever). Anything else is answered as a
file the shelf does not hold.

A device asks by sha256 alone, so files with the same bytes under several names (in one bundle or
in several) are one file here, served under one of their names; the device writes it under the
name its manifest gives (``edge_client.artifacts``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from protocols.bundle_manifest import MANIFEST_FILENAME, parse_manifest, read_manifest_bytes
from protocols.envelope import Envelope, EnvelopeError
from protocols.files import stream_sha256
from protocols.payloads.artifacts import artifact_message, missing_message, parse_get
from protocols.regular_file import open_regular, read_regular_file
from protocols.topics import AGGREGATOR_ID

from aggregator.jobs.registry import config_fields
from aggregator.security.repeat_limit import RepeatLimiter

MAX_ARTIFACT_BYTES = 256 * 1024 * 1024
ARTIFACT_RESEND_S = 30.0        # a file is sent to a device at most twice per this (RepeatLimiter)

log = logging.getLogger("fedfleet.aggregator")


class ArtifactShelf:
    def __init__(self, bundles: list[Path] = ()):
        self._files: dict[str, tuple[Path, int]] = {}      # sha256 -> (path, size in bytes)
        self.answers = RepeatLimiter(ARTIFACT_RESEND_S)         # a file is megabytes, the ask a few hundred bytes
        self.bundles: list[str] = []            # manifest sha256s, in the order added
        for b in bundles:
            self.add_bundle(b)

    def add_bundle(self, bundle_dir: Path) -> str:
        """Index a bundle; returns its manifest's sha256 (what a job announces to devices)."""
        bundle_dir = Path(bundle_dir)
        # the bytes validated are the bytes indexed (read once)
        manifest, raw = read_manifest_bytes(bundle_dir / MANIFEST_FILENAME)
        for spec in parse_manifest(raw, manifest).artifacts:       # the format devices read, validated
            path = bundle_dir / spec.file
            if path.resolve().parent != bundle_dir.resolve():
                raise ValueError(f"manifest lists a file outside its bundle: {spec.file!r}")
            try:        # a regular file only, its size and digest those of the file opened (a folder
                # whose size matched the manifest's escaped as IsADirectoryError: a review's finding)
                with open_regular(path) as handle:
                    size = os.fstat(handle.fileno()).st_size
                    if size > MAX_ARTIFACT_BYTES:
                        raise ValueError(f"{path} is larger than {MAX_ARTIFACT_BYTES} bytes")
                    if size != spec.size_bytes:     # devices hold no reply past the size the manifest gives
                        raise ValueError(f"{path} is {size} bytes, its manifest says {spec.size_bytes}")
                    digest = stream_sha256(handle)
            except OSError as exc:
                raise ValueError(f"{path}: {exc.strerror} (its manifest lists a regular file of {spec.size_bytes} "
                                 "bytes)") from None
            if digest != spec.sha256:
                raise ValueError(f"{path}: sha256 differs from the manifest's (tampered or stale bundle)")
            self._files[spec.sha256] = (path, size)
        digest = hashlib.sha256(raw).hexdigest()
        self._files[digest] = (manifest, len(raw))
        if digest not in self.bundles:
            self.bundles.append(digest)
        return digest

    def get(self, sha256: str) -> tuple[str, bytes] | None:
        """(name, bytes) of the file indexed under ``sha256``, read now; None when the shelf holds
        none, or the path no longer holds it (gone, not a regular file, other bytes)."""
        held = self._files.get(sha256)
        if held is None:
            return None
        path, size = held
        try:        # never blocks on a FIFO, never reads past the indexed size
            data = read_regular_file(path, "artifact", size)
        except ValueError as exc:
            log.error("artifact %s… not served: %s", sha256[:16], exc)
            return None
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            log.error("artifact %s… not served: %s no longer holds the bytes indexed", sha256[:16], path)
            return None
        return path.name, data

    def __contains__(self, sha256: str) -> bool:
        return sha256 in self._files


def artifact_reply(shelf: ArtifactShelf | None, device: str, ask: Envelope) -> tuple[Envelope | None, str | None]:
    """What to send ``device`` whose ``ask`` (an ``artifact.get``) names a file's sha256, and the
    refusal to count (or None): the file; ``artifact.missing`` when the shelf holds no such file (so
    the device stops asking instead of waiting out its timeout); nothing when the shelf answered
    this ask twice lately, or the ask is malformed (refused)."""
    try:
        sha256 = parse_get(ask)
    except EnvelopeError as exc:
        return None, str(exc)
    if shelf is None or sha256 not in shelf:
        return missing_message(AGGREGATOR_ID, sha256, ask.id), f"no artifact {sha256[:16]} on this aggregator"
    if not shelf.answers.allow(device, sha256):
        log.info("artifact %s… asked again by %s: the last answers stand", sha256[:16], device)
        return None, None
    served = shelf.get(sha256)
    if served is None:          # changed on disk since indexed: the device stops asking, as for no file
        return missing_message(AGGREGATOR_ID, sha256, ask.id), f"artifact {sha256[:16]} changed on disk since indexed"
    return artifact_message(AGGREGATOR_ID, sha256, *served), None


def with_served_bundle(kind: str, config: dict, shelf: ArtifactShelf | None) -> dict:
    """A job config with the bundle its devices run settled when the job is created, not discovered
    by devices declining every task: a kind that names a bundle (``bundle_sha256``) gets the one
    bundle this aggregator serves when its config names none; a config naming a bundle the
    aggregator does not serve (while it serves some) is refused, as is a silent choice between
    several served bundles. Returns a new dict; ValueError says what to change."""
    if shelf is None or not shelf.bundles or "bundle_sha256" not in {f.name for f in config_fields(kind)}:
        return config
    named = config.get("bundle_sha256") or ""
    if not named:
        if len(shelf.bundles) > 1:
            raise ValueError(f"this aggregator serves {len(shelf.bundles)} bundles "
                             f"({', '.join(b[:16] + '…' for b in shelf.bundles)}): name the job's in bundle_sha256")
        return {**config, "bundle_sha256": shelf.bundles[0]}
    if named not in shelf.bundles:
        raise ValueError(f"bundle_sha256 {named[:16]}… is not a bundle this aggregator serves "
                         f"({', '.join(b[:16] + '…' for b in shelf.bundles)}): pass its directory with --artifacts "
                         "or leave bundle_sha256 out to use the served one")
    return config
